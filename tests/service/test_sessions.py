"""Session bookkeeping (pins, bytes of puts in flight, credentials, TTL) and the sweep of
socket folders killed servers left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from persisting.errors import CapacityError, ProtocolError, SessionExpiredError
from persisting.service.bulk.server import remove_orphaned_sockets
from persisting.service.sessions import SessionTable


def test_sessions_expire_without_renewal_and_give_back_their_holdings() -> None:
    now = [0.0]
    table = SessionTable(ttl_s=10.0, clock=lambda: now[0])
    a, b = table.open({"pid": 1}), table.open({"pid": 2})
    table.add_pin(a, ("m", "k1"))
    table.add_pin(a, ("m", "k1"))
    assert table.pin_count == 2
    now[0] = 8.0
    table.touch(b.sid)
    now[0] = 10.5
    assert table.authenticate(a.key_id, a.secret) is None  # past its deadline: no data path
    gone = table.expire()
    assert [s.sid for s in gone] == [a.sid]
    assert gone[0].pins == {("m", "k1"): 2}
    with pytest.raises(SessionExpiredError):
        table.touch(a.sid)
    assert not table.drop_pin(b, ("m", "k1"))
    assert table.authenticate(b.key_id, b.secret) is b
    with pytest.raises(ProtocolError, match="needs a session"):
        table.touch(None)


def test_credentials_authenticate_only_their_own_live_session() -> None:
    table = SessionTable(ttl_s=10.0)
    a, b = table.open({}), table.open({})
    assert table.authenticate(a.key_id, a.secret) is a
    assert table.authenticate(a.key_id, b.secret) is None
    assert table.authenticate(b"\0" * 16, a.secret) is None
    assert table.authenticate("text", a.secret) is None  # type: ignore[arg-type]
    table.close(a.sid)
    assert table.authenticate(a.key_id, a.secret) is None


def test_bytes_in_flight_are_bounded_per_session_and_in_all_and_freed_with_it() -> None:
    table = SessionTable(ttl_s=10.0, max_staged_bytes=100, max_session_staged_bytes=60)
    a, b = table.open({}), table.open({})
    table.stage(a, 60)
    with pytest.raises(CapacityError, match="a session's bound"):
        table.stage(a, 1)
    table.stage(b, 40)
    with pytest.raises(CapacityError, match="the server's bound"):
        table.stage(b, 1)
    table.close(a.sid)  # a put still in flight when its session ends
    assert table.staged_bytes == 40
    table.unstage(a, 60)  # ... ends later: nothing is counted twice
    assert table.staged_bytes == 40
    table.unstage(b, 40)
    assert table.staged_bytes == 0


def test_socket_folders_of_killed_servers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"persisting-kv-{dead.pid}-abc"
    mine = tmp_path / f"persisting-kv-{os.getpid()}-def"
    other = tmp_path / "persisting-kv-notapid"
    for d in (orphan, mine, other):
        d.mkdir()
        (d / "data.sock").write_bytes(b"")
    assert remove_orphaned_sockets(str(tmp_path)) == 1
    assert not orphan.exists() and mine.exists() and other.exists()
