"""`persisting serve` as a child process, for the examples that talk to a running server.

:func:`persisting_serve` starts the server on a free 127.0.0.1 port in its own process
group, waits for its ``persisting: serving ...`` line, yields its address, and stops the
whole group afterwards (SIGTERM for a clean stop, then SIGKILL), whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def persisting_command() -> list[str]:
    """The ``persisting`` console script beside this interpreter (else ``python -m``)."""
    script = Path(sys.executable).with_name("persisting")
    return [str(script)] if script.exists() else [sys.executable, "-m", "persisting.cli"]


@contextlib.contextmanager
def persisting_serve(
    root: Path, model: str, settings_env: Mapping[str, str] | None = None, timeout_s: float = 60
) -> Iterator[str]:
    """Run ``persisting serve`` for ``model`` on ``root``; yields the server's address.

    ``settings_env`` holds ``PERSISTING_*`` variables for the server (its settings).
    """
    addr = f"127.0.0.1:{free_port()}"
    arguments = ["serve", "--storage-path", str(root), "--model", model, "--addr", addr]
    env = {**os.environ, **(settings_env or {})}
    print("starting: persisting", " ".join(arguments))
    with tempfile.TemporaryDirectory(prefix="persisting-serve-log-") as logs:
        log = Path(logs) / "serve.log"
        with log.open("wb") as out:
            server = subprocess.Popen(
                [*persisting_command(), *arguments],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as a whole below
            )
        try:
            print(_wait_until_serving(server, log, timeout_s))
            yield addr
        finally:
            _stop(server)
            print(f"server stopped (exit code {server.returncode})")


def _wait_until_serving(server: subprocess.Popen[bytes], log: Path, timeout_s: float) -> str:
    """The server logs ``persisting: serving ...`` once its actor is registered (after a
    timestamp and level, or as a JSON field with --log-json)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            if "persisting: serving" in line:
                return line
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}):\n{text}")
        time.sleep(0.1)
    raise RuntimeError(f"the server did not start in {timeout_s}s:\n{log.read_text()}")


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server stops cleanly), then SIGKILL whatever is left of its group."""
    if server.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=20)
