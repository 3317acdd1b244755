"""An unprivileged local user against a default `persisting serve`: nothing executed, no answer.

    python -m tests.reliability.harness_service_attack [--rounds 3] [--json OUT]

Needs root (the attacker is a forked child that drops to uid/gid 65534). One server is
started the default way (no passphrase configured: it generates one and serves loopback
only) and one client of the server's user connects with no configuration. Then, per round,
the attacker sends a pickle whose unpickling would create a file as the server's user
through every door it can find:

* the generated passphrase file (to read it);
* Pulsing without the passphrase (resolve the actor, ask it);
* raw bytes to the Pulsing port (HTTP/1.1, an HTTP/2 preface, a bare pickle);
* raw bytes to the data port (a guessed credential frame, then the pickle);
* the data path's Unix socket, and the same socket again after its folder and mode are
  opened up, so that only the peer-credential check stands.

A door *answers* when anything but a TLS alert or a refusal comes back. Prints (and with
``--json`` writes) one JSON summary; exits 1 if anything ran or answered.
"""

from __future__ import annotations

import argparse
import asyncio
import encodings.idna  # noqa: F401 - loaded while root: the attacker cannot read /root
import glob
import json
import os
import pickle
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import pulsing
import pulsing.core.remote

from tests.reliability.rel_common import emit
from tests.service.service_helpers import wait_for_log

REPO = Path(__file__).resolve().parents[2]
MODEL = "reliability/attacked"
NOBODY = 65534
PERSISTING = str(Path(sys.executable).with_name("persisting"))


class CreatesFile:
    """Unpickling this creates ``path`` -- as whoever unpickles it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def as_nobody(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a forked child running as uid/gid 65534; its JSON result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_end)
            asyncio.run(asyncio.sleep(0))  # the event loop machinery, loaded as root
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write_end, json.dumps({"result": fn(*args)}).encode())
        except BaseException as exc:
            os.write(write_end, json.dumps({"crashed": repr(exc)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    out = json.loads(data or b"{}")
    if "crashed" in out:
        raise RuntimeError(f"the attacker crashed: {out['crashed']}")
    return out["result"]


def attack(
    addr: str, data_port: int, marker: str, channel: str, passphrase_path: str
) -> dict[str, Any]:
    """Every door, as the attacker (see the module docstring)."""
    out: dict[str, Any] = {"uid": os.getuid()}
    evil = pickle.dumps(CreatesFile(marker))
    try:
        with open(passphrase_path) as handle:
            out["passphrase_file"] = "read: " + handle.read()
    except OSError as exc:
        out["passphrase_file"] = type(exc).__name__
    out["data_socket"] = channel_door(channel, evil)
    out["data_port"] = data_port_door(data_port, evil)
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
                try:
                    answer = sock.recv(4096)
                except OSError:
                    answer = b""
            out["raw"].append(answer.decode("latin-1"))
        except OSError as exc:
            out["raw"].append(type(exc).__name__)
    out["pulsing"] = asyncio.run(via_pulsing(addr, marker))
    return out


def _frames(evil: bytes) -> list[bytes]:
    """A guessed credential frame, the pickle framed as a frame, and a request."""
    guess = msgpack.packb({"id": b"\0" * 16, "secret": b"\0" * 32})
    request = msgpack.packb({"op": "get", "model": MODEL, "keys": [f"{MODEL}@1@0@1@bfloat16"]})
    return [struct.pack("<I", len(f)) + f for f in (guess, evil, request)]


def _door(sock: socket.socket, evil: bytes) -> str:
    try:
        for frame in _frames(evil):
            sock.sendall(frame)
        answer = sock.recv(4096)
    except OSError as exc:
        return f"no answer ({type(exc).__name__})"
    return "answer: " + answer.decode("latin-1") if answer else "no answer (closed)"


def channel_door(path: str, evil: bytes) -> str:
    """Connect to the data path's Unix socket and send frames; what came back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        try:
            sock.connect(path)
        except OSError as exc:
            return type(exc).__name__
        return _door(sock, evil)


def data_port_door(port: int, evil: bytes) -> str:
    """Connect to the data port and send frames; what came back."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            return _door(sock, evil)
    except OSError as exc:
        return type(exc).__name__


async def via_pulsing(addr: str, marker: str) -> dict[str, Any]:
    """What an attacker with the Pulsing library but no passphrase gets."""
    await pulsing.init(addr=None, seeds=[addr])
    system = pulsing.get_system()
    try:
        ref = await asyncio.wait_for(system.resolve_named("kvstore"), 8)
    except BaseException as exc:
        return {"resolved": False, "error": type(exc).__name__}
    try:
        reply = await asyncio.wait_for(ref.ask(CreatesFile(marker)), 8)
        return {"resolved": True, "answered": True, "reply": repr(reply)[:200]}
    except BaseException as exc:
        return {"resolved": True, "answered": False, "error": type(exc).__name__}


def answered(door: Any) -> bool:
    """Whether a door's outcome is an answer (anything but a TLS alert or a refusal)."""
    if isinstance(door, dict):
        return door.get("answered") is True
    if isinstance(door, list):
        return any(answered(d) for d in door)
    text = str(door)
    if text.startswith("read: "):
        return True
    return text.startswith("answer") or not (
        text == "" or text.startswith("\x15\x03") or text.startswith("no answer") or text.isalpha()
    )


def _legit_client(addr: str) -> bool:
    """A client of the server's user, in its own process, with no configuration."""
    code = (
        "import asyncio, os, sys, torch\n"
        "from persisting.service import KVCacheClient\n"
        "async def main():\n"
        f"    c = await KVCacheClient.connect(seeds=[{addr!r}], model={MODEL!r})\n"
        "    v = torch.ones(2, 2, 16, 64, dtype=torch.bfloat16)\n"
        f"    await c.put('{MODEL}@1@0@1@bfloat16', v)\n"
        f"    ok = torch.equal(await c.get('{MODEL}@1@0@1@bfloat16'), v)\n"
        "    await c.close()\n"
        "    return ok\n"
        "print('OK' if asyncio.run(main()) else 'WRONG', flush=True)\n"
        "os._exit(0)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    return out.stdout.strip() == "OK"


def run(rounds: int = 3) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise SystemExit("run as root: the attacker is a child that drops to uid 65534")
    from persisting.config import ServiceSettings
    from persisting.service.passphrase import passphrase_file

    tmp = Path(tempfile.mkdtemp(prefix="service-attack-"))
    tmp.chmod(0o700)  # the server (root) could create the marker here; nobody cannot
    marker = tmp / "pwned"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    log = tmp / "serve.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [PERSISTING, "serve", "--storage-path", str(tmp / "root"), "-m", MODEL,
             "--addr", addr, "--no-events"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for_log(log, "persisting: serving", server, timeout_s=90)
        legit = _legit_client(addr)
        [channel] = glob.glob(f"/tmp/persisting-kv-{server.pid}-*/data.sock")
        found = re.search(r"data path at 127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
        assert found is not None, log.read_text(errors="replace")
        data_port = int(found.group(1))
        secret = str(passphrase_file(ServiceSettings()))
        rounds_out = [
            as_nobody(attack, addr, data_port, str(marker), channel, secret) for _ in range(rounds)
        ]
        os.chmod(os.path.dirname(channel), 0o755)  # a careless operator opens the folder up
        os.chmod(channel, 0o777)
        evil = pickle.dumps(CreatesFile(str(marker)))
        opened = [as_nobody(channel_door, channel, evil) for _ in range(rounds)]
        alive = server.poll() is None
    finally:
        os.killpg(server.pid, 9)
        server.wait(30)
    doors = {
        "passphrase_file": [r["passphrase_file"] for r in rounds_out],
        "pulsing_without_passphrase": [r["pulsing"] for r in rounds_out],
        "raw_bytes_to_the_port": [d for r in rounds_out for d in r["raw"]],
        "data_port": [r["data_port"] for r in rounds_out],
        "data_socket": [r["data_socket"] for r in rounds_out],
        "data_socket_opened_up": opened,
    }
    result = {
        "harness": "service_attack",
        "attacker_uid": rounds_out[0]["uid"],
        "rounds": rounds,
        "attempts": sum(len(v) for v in doors.values()),
        "doors": doors,
        "answered": {name: sum(answered(d) for d in outcomes) for name, outcomes in doors.items()},
        "executed": marker.exists(),
        "server_alive_after": alive,
        "legit_client_connected_unconfigured": legit,
        "seconds": round(time.perf_counter() - started, 1),
    }
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.rounds)
    emit(result, args.json)
    ok = not result["executed"] and not any(result["answered"].values())
    sys.stdout.flush()
    os._exit(0 if ok and result["legit_client_connected_unconfigured"] else 1)


if __name__ == "__main__":
    main()
