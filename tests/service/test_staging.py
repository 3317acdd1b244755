"""What one passphrase holder can hold: staging space for uploads (and message-path
transfers, and data-path puts) is bounded per session as well as per server, staged uploads
expire however often their session renews, a part sent twice counts once, and a put whose
parts do not cover its value is refused (even without a checksum)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from persisting.errors import CapacityError, ProtocolError
from persisting.kv import KVStore, open_kv_store
from persisting.kv.layout import encode_value
from persisting.service.handler import StorageHandler
from persisting.service.protocol import make_request, unwrap_reply
from persisting.service.sessions import SessionTable, Staged
from tests.service.service_helpers import MODEL, key, tensor
from tests.service.test_handler import FakeClock

PART = 64 << 10


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    with open_kv_store(tmp_path / "root", MODEL, memory_bytes=8 << 20, disk_bytes=64 << 20) as s:
        yield s


@pytest.fixture
def handler(store: KVStore, clock: FakeClock) -> Iterator[StorageHandler]:
    h = StorageHandler(
        {MODEL: store},
        lease_ttl_s=10.0,
        message_part_bytes=PART,
        max_staged_bytes=4 << 20,
        max_session_staged_bytes=2 << 20,
        staged_ttl_s=30.0,
        clock=clock,
    )
    yield h
    h.close()


def call(handler: StorageHandler, op: str, sid: str | None = None, **args: Any) -> Any:
    reply = asyncio.run(handler.handle(make_request(op, sid=sid, model=MODEL, **args)))
    return unwrap_reply(reply)


def hello(handler: StorageHandler) -> str:
    return str(call(handler, "hello", client={})["sid"])


def staged(handler: StorageHandler) -> int:
    return int(call(handler, "stats", hello(handler))["service"]["staged_bytes"])


def test_one_session_cannot_take_the_whole_server_staging(handler: StorageHandler) -> None:
    greedy = hello(handler)
    call(handler, "upload_begin", greedy, nbytes=1 << 20)
    call(handler, "upload_begin", greedy, nbytes=1 << 20)
    with pytest.raises(CapacityError, match="session"):  # its 2 MiB are taken
        call(handler, "upload_begin", greedy, nbytes=1 << 20)
    other = hello(handler)  # the server's other 2 MiB are still there for others
    call(handler, "upload_begin", other, nbytes=2 << 20)
    with pytest.raises(CapacityError, match="server"):
        call(handler, "upload_begin", hello(handler), nbytes=1 << 20)


def test_uploads_expire_however_often_their_session_renews(
    handler: StorageHandler, clock: FakeClock
) -> None:
    sid = hello(handler)
    upload = call(handler, "upload_begin", sid, nbytes=2 << 20)
    for _ in range(4):  # 40 s of renewals, each inside the session's TTL
        clock.now += 10.0
        call(handler, "renew", sid)
        handler.expire_sessions()
    assert handler.sessions.staged_bytes == 0  # the upload is gone, the session is not
    with pytest.raises(ProtocolError):
        call(handler, "upload_part", sid, upload=upload, offset=0, data=bytes(PART))
    call(handler, "upload_begin", sid, nbytes=2 << 20)  # its room is back
    assert handler.counters["staged_expired"] == 1


def _upload_item(
    handler: StorageHandler, sid: str, i: int, offsets: list[int], checksum: bool
) -> dict[str, Any]:
    layout, view = encode_value(tensor(i, tokens=64, hidden=1024), "KV_2LTD")  # 1 MiB
    upload = call(handler, "upload_begin", sid, nbytes=layout.nbytes)
    for offset in offsets:
        data = bytes(view[offset : offset + PART])
        call(handler, "upload_part", sid, upload=upload, offset=offset, data=data)
    item = {"key": str(key(i)), "layout": layout.to_dict(), "source": {"upload": upload}}
    if checksum:
        from persisting.kv.layout import checksum as digest

        item["checksum"] = digest(view)
    return item


def test_a_repeated_part_counts_once_and_a_put_with_a_hole_is_refused(
    handler: StorageHandler, store: KVStore
) -> None:
    sid = hello(handler)
    whole = list(range(0, 1 << 20, PART))
    # every part once, the first three twice: counted once each, stored whole
    item = _upload_item(handler, sid, 1, whole[:3] + whole, checksum=True)
    assert call(handler, "put", sid, items=[item], fmt="KV_2LTD")[0]["stored"]
    assert store.contains(key(1))
    # one part missing, one sent twice: as many bytes as the value, but with a hole.
    # Counting bytes used to store it (with zeros in the hole) when no checksum was sent.
    holey = whole[:-1] + whole[:1]
    item = _upload_item(handler, sid, 2, holey, checksum=False)
    with pytest.raises(ProtocolError, match="upload has"):
        call(handler, "put", sid, items=[item], fmt="KV_2LTD")
    assert not store.contains(key(2))


def test_parts_that_overlap_or_change_length_are_refused(handler: StorageHandler) -> None:
    sid = hello(handler)
    upload = call(handler, "upload_begin", sid, nbytes=1 << 20)
    call(handler, "upload_part", sid, upload=upload, offset=0, data=bytes(PART))
    with pytest.raises(ProtocolError, match="overlaps"):
        call(handler, "upload_part", sid, upload=upload, offset=PART // 2, data=bytes(PART))
    with pytest.raises(ProtocolError, match="was"):
        call(handler, "upload_part", sid, upload=upload, offset=0, data=bytes(PART // 2))


def test_the_table_bounds_per_session_and_expires_by_deadline() -> None:
    clock = FakeClock()
    table = SessionTable(
        ttl_s=10.0,
        max_staged_bytes=100,
        clock=clock,
        max_session_staged_bytes=60,
        staged_ttl_s=5.0,
    )
    a, b = table.open({}), table.open({})
    first = table.stage(a, Staged(np.zeros(60, np.uint8), 60))
    with pytest.raises(CapacityError):
        table.stage(a, Staged(np.zeros(1, np.uint8), 1))
    table.stage(b, Staged(np.zeros(40, np.uint8), 40))
    clock.now += 6.0
    with pytest.raises(ProtocolError, match="expired"):  # found past its deadline: dropped
        table.staged(a, first)
    assert table.staged_bytes == 40
    assert table.expire_staged() == 1 and table.staged_bytes == 0
