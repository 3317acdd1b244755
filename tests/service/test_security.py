"""Nothing answers an unauthenticated peer: a default `persisting serve`, attacked by a
local user of another uid (we run as root: a forked child drops to uid 65534).

The attacker sends a pickle whose unpickling would create a file as the server's user, over
every door it can find: Pulsing without the passphrase, raw bytes to the port, the local
channel (also with its folder opened up, so only the peer-credential check stands). Nothing
may be executed, and nothing may answer.
"""

from __future__ import annotations

import asyncio
import encodings.idna  # noqa: F401 - the attacker (no access to /root) needs it loaded
import glob
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pulsing
import pulsing.core.remote
import pytest
from service_helpers import (
    MODEL,
    REPO,
    free_port,
    processes,
    run_client,
    server_env,
    spawn,
    wait_for_log,
)

from persisting.config import ServiceSettings
from persisting.service.passphrase import passphrase_file

PERSISTING = str(Path(sys.executable).with_name("persisting"))
NOBODY = 65534

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:lance is not fork-safe"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]


class _CreatesFile:
    """Unpickling this creates ``path`` -- as whoever unpickles it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _as_nobody(fn: Any, *args: Any, timeout_s: float = 90) -> dict[str, Any]:
    """Run ``fn(*args)`` in a forked child with uid/gid 65534; its JSON result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker
        code = 0
        try:
            os.close(read_end)
            asyncio.run(asyncio.sleep(0))  # the event loop machinery, loaded as root
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = fn(*args)
            os.write(write_end, json.dumps(result).encode())
        except BaseException as exc:
            os.write(write_end, json.dumps({"crashed": repr(exc)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks) or b"{}")
    assert "crashed" not in result, result
    return result


def _attack(addr: str, marker: str, channel: str, passphrase_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"uid": os.getuid()}
    evil = pickle.dumps(_CreatesFile(marker))
    try:
        with open(passphrase_path) as handle:
            out["passphrase"] = handle.read()
    except OSError as exc:
        out["passphrase"] = type(exc).__name__
    out["channel"] = _channel_door(channel, evil)
    host, port = addr.rsplit(":", 1)
    out["raw"] = []
    for payload in (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(evil) + evil,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + evil,
        evil,
    ):
        try:
            with socket.create_connection((host, int(port)), timeout=3) as sock:
                sock.sendall(payload)
                sock.settimeout(3)
                try:
                    answer = sock.recv(4096)
                except OSError:
                    answer = b""
            out["raw"].append(answer.decode("latin-1"))
        except OSError as exc:
            out["raw"].append(type(exc).__name__)
    out["pulsing"] = asyncio.run(_via_pulsing(addr, marker))
    return out


def _channel_door(path: str, evil: bytes) -> str:
    """Connect to the local channel and send frames; what came back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(3)
        try:
            sock.connect(path)
        except OSError as exc:
            return type(exc).__name__
        request = pickle.dumps({"v": 2, "op": "stats", "sid": "guess", "model": MODEL})
        try:
            for frame in (request, evil):
                sock.sendall(struct.pack("<IQ", len(frame), 1) + frame)
            answer = sock.recv(4096)
        except OSError as exc:
            return f"no answer ({type(exc).__name__})"
        return "answer: " + answer.decode("latin-1") if answer else "no answer (closed)"


async def _via_pulsing(addr: str, marker: str) -> dict[str, Any]:
    """What an attacker with the Pulsing library but no passphrase gets."""
    await pulsing.init(addr=None, seeds=[addr])
    system = pulsing.get_system()
    try:
        ref = await asyncio.wait_for(system.resolve_named("kvstore"), 8)
    except BaseException as exc:
        return {"resolved": False, "error": type(exc).__name__}
    try:
        reply = await asyncio.wait_for(ref.ask(_CreatesFile(marker)), 8)
        return {"resolved": True, "answered": True, "reply": repr(reply)[:200]}
    except BaseException as exc:
        return {"resolved": True, "answered": False, "error": type(exc).__name__}


def test_another_user_gets_nothing_executed_and_no_answer_from_a_default_server(
    tmp_path: Path,
) -> None:
    tmp_path.chmod(0o700)  # the server (root) may create the marker here; nobody cannot
    marker = tmp_path / "pwned"
    port = free_port()
    log = tmp_path / "serve.log"
    with processes() as procs:
        server = spawn(
            [
                PERSISTING,
                "serve",
                "--storage-path",
                str(tmp_path / "root"),
                "-m",
                MODEL,
                "--addr",
                f"127.0.0.1:{port}",
            ],
            server_env(tmp_path / "root"),
            log,
        )
        procs.append(server)
        wait_for_log(log, "persisting: serving", server)
        # A client of the server's user connects with no configuration at all (it reads the
        # generated passphrase), and so the server opens its local channel.
        seeds = [f"127.0.0.1:{port}"]
        assert run_client("connect_only", {"seeds": seeds}) == {"connected": True, "exact": True}
        [channel] = glob.glob(f"/tmp/persisting-kv-{server.pid}-*/service.sock")
        secret_file = str(passphrase_file(ServiceSettings()))
        args = (f"127.0.0.1:{port}", str(marker), channel, secret_file)
        closed = _as_nobody(_attack, *args)
        # The folder's mode is the first barrier of the local channel; open it up, as a
        # careless operator might, and the peer-credential check must still refuse.
        os.chmod(os.path.dirname(channel), 0o755)
        os.chmod(channel, 0o777)
        opened = _as_nobody(_channel_door, channel, pickle.dumps(_CreatesFile(str(marker))))
        alive = server.poll() is None
    assert closed["uid"] == NOBODY
    assert not marker.exists(), "the server unpickled an attacker's object"
    assert closed["passphrase"] == "PermissionError"
    assert closed["channel"] == "PermissionError"
    assert opened.startswith("no answer"), opened
    # Raw bytes to the port: at most a TLS alert (record type 0x15), never a frame of the
    # service's HTTP/2 transport (a server without TLS answers with its SETTINGS frame).
    assert all(r == "" or r.startswith("\x15\x03") for r in closed["raw"]), closed["raw"]
    assert closed["pulsing"].get("answered") is not True, closed["pulsing"]
    assert alive


def test_a_non_loopback_address_without_a_passphrase_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    env = server_env(tmp_path / "root")
    out = subprocess.run(
        [
            PERSISTING,
            "serve",
            "--storage-path",
            str(tmp_path / "root"),
            "-m",
            MODEL,
            "--addr",
            f"0.0.0.0:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr
    assert "not a loopback address" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    launcher = subprocess.run(
        [
            str(Path(sys.executable).with_name("pulsing")),
            "actor",
            "persisting.actors.kv_cache_storage.KVCacheStorageActor",
            "-",
            "--name",
            "kvstore",
            "--addr",
            f"0.0.0.0:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert launcher.returncode == 2, launcher.stdout + launcher.stderr
    assert "not a loopback address" in launcher.stderr
    assert "Traceback" not in launcher.stderr, launcher.stderr
