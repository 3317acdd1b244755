"""Shared pieces of the service tests: keys, tensors, settings and server processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from persisting.kv import ChunkKey
from tests.timing import wait_until

REPO = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3-8B"
OTHER_MODEL = "mistralai/Mistral-7B"


def key(i: int, model: str = MODEL, dtype: str = "bfloat16") -> ChunkKey:
    """Chunk ``i``'s key; ``dtype`` must be its value's (a put checks it)."""
    return ChunkKey(model, 1, 0, i * 104_729 - 7, dtype)


def tensor(seed: int, tokens: int = 16, hidden: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, tokens, hidden, generator=g).to(torch.bfloat16)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env(root: Path, **extra: str) -> dict[str, str]:
    """Environment of a server process: settings through PERSISTING_* variables only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env.update(
        PYTHONPATH=str(REPO),
        PERSISTING_STORAGE_PATH=str(root),
        PERSISTING_MODELS=MODEL,
        PERSISTING_KV__MEMORY_BYTES=str(64 << 20),
        PERSISTING_KV__DISK_BYTES=str(512 << 20),
        PERSISTING_SERVICE__LEASE_TTL_S="2",
        PERSISTING_SERVICE__MEMBER_RETRY_S="0.5",
        PERSISTING_SERVICE__DISCOVERY_TIMEOUT_S="15",
    )
    env.update(extra)
    return env


def spawn(
    args: list[str], env: dict[str, str], log: Path, cwd: Path = REPO
) -> subprocess.Popen[bytes]:
    """A process in its own session (so the whole group can be killed), output to ``log``."""
    handle = open(log, "wb")  # noqa: SIM115 - closed by the OS when the child exits
    return subprocess.Popen(
        args, env=env, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
    )


def start_pulsing_actor(
    root: Path, port: int, log: Path, name: str = "kvstore", seeds: str | None = None, **extra: str
) -> subprocess.Popen[bytes]:
    """A server started by Pulsing's own launcher (no constructor arguments)."""
    args = [
        str(Path(sys.executable).with_name("pulsing")),
        "actor",
        "actors.kv_cache_storage.KVCacheStorageActor",
        "-",
        "--name",
        name,
        "--addr",
        f"127.0.0.1:{port}",
    ]
    if seeds:
        args += ["--seeds", seeds]
    return spawn(args, server_env(root, **extra), log)


def start_serve(root: Path, port: int, log: Path, **extra: str) -> subprocess.Popen[bytes]:
    """A server started by ``actors.launch.serve`` (what ``persisting serve`` runs)."""
    env = server_env(root, PERSISTING_SERVICE__ADDR=f"127.0.0.1:{port}", **extra)
    return spawn([sys.executable, "-m", "actors.launch"], env, log)


def wait_for_log(
    log: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 60
) -> None:
    """Wait until ``text`` is in ``log``, which ``proc`` writes: an AssertionError with the
    log if it exits first or never writes it."""

    def logged() -> bool:
        return log.exists() and text in log.read_text(errors="replace")

    try:
        wait_until(lambda: logged() or proc.poll() is not None, f"{text!r}", timeout_s)
    except AssertionError:
        raise AssertionError(f"{text!r} not seen in {timeout_s}s:\n{log.read_text()}") from None
    if not logged():
        raise AssertionError(f"process exited ({proc.returncode}):\n{log.read_text()}")


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Collects processes and kills every group on the way out, whatever happened."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            kill_group(proc)


def run_client(
    task: str, args: dict[str, Any], env: dict[str, str] | None = None, timeout_s: float = 120
) -> dict[str, Any]:
    """Run ``tests/service/client_tasks.py <task>`` in a fresh process; its JSON result."""
    env = dict(env or {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")})
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "service" / "client_tasks.py"),
            task,
            json.dumps(args),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        start_new_session=True,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(
        f"client task {task} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
