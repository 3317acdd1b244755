"""The service passphrase: generated private to its user, refused when others could read it."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from persisting.config import ServiceSettings
from persisting.errors import ConfigError
from persisting.service.passphrase import (
    client_passphrase,
    generated_passphrase,
    is_loopback,
    passphrase_file,
    read_passphrase,
    server_passphrase,
)


def test_a_generated_passphrase_is_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "state" / "persisting" / "passphrase"
    first = generated_passphrase(path)
    assert len(first) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert generated_passphrase(path) == first == read_passphrase(path)
    assert [p.name for p in path.parent.iterdir()] == ["passphrase"]  # nothing left aside


def _generate(path: str, out: multiprocessing.Queue) -> None:
    out.put(generated_passphrase(Path(path)))


@pytest.mark.slow
def test_servers_starting_at_once_agree_on_one_passphrase(tmp_path: Path) -> None:
    path = str(tmp_path / "p" / "passphrase")
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=_generate, args=(path, out)) for _ in range(4)]
    for proc in procs:
        proc.start()
    got = {out.get(timeout=30) for _ in procs}
    for proc in procs:
        proc.join(30)
    assert got == {read_passphrase(Path(path))}


def test_a_passphrase_file_others_could_read_or_that_another_user_owns_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "passphrase"
    generated_passphrase(path)
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_passphrase(path)
    path.chmod(0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(path, 65534, 65534)
        with pytest.raises(ConfigError, match="another user"):
            read_passphrase(path)


def test_where_clients_and_servers_take_their_passphrase_from(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    service = ServiceSettings(passphrase_file=kept)
    assert passphrase_file(service) == kept
    with pytest.raises(ConfigError, match="no service passphrase"):
        client_passphrase(None, service)  # no server on this host generated one yet
    generated = server_passphrase(service, "127.0.0.1:8610", [])
    assert client_passphrase(None, service) == generated
    assert client_passphrase("given", service) == "given"
    configured = ServiceSettings(passphrase="s3cret", passphrase_file=kept)
    assert client_passphrase(None, configured) == "s3cret"
    assert server_passphrase(configured, "0.0.0.0:8610", ["10.0.0.2:8610"]) == "s3cret"


def test_beyond_loopback_a_server_needs_a_configured_passphrase(tmp_path: Path) -> None:
    service = ServiceSettings(passphrase_file=tmp_path / "p")
    for addr, seeds in (("0.0.0.0:8610", []), ("127.0.0.1:8610", ["10.1.2.3:8610"])):
        with pytest.raises(ConfigError, match="not a loopback address"):
            server_passphrase(service, addr, seeds)
    assert not (tmp_path / "p").exists()  # nothing generated for a refused start
    assert all(is_loopback(a) for a in ("127.0.0.1:1", "127.8.0.1:1", "localhost:1", "[::1]:1"))
    assert not any(is_loopback(a) for a in ("0.0.0.0:1", "10.0.0.1:1", "[::]:1", "host:1"))
