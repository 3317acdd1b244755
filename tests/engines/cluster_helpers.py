"""A ``persisting serve`` member for the engine tests of the ``cluster`` key."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.engines.engine_helpers import free_port
from tests.service.service_helpers import kill_group, server_env, spawn, wait_for_log


@contextmanager
def cluster_member(tmp: Path) -> Iterator[dict[str, Any]]:
    """One ``persisting serve`` member under ``tmp``, started without ``--model`` (it serves
    whatever namespace an authenticated client opens) and with a passphrase: its ``proc``,
    its ``root`` and the engines' ``cluster`` key. SIGKILLed at the end if still running."""
    passphrase = tmp / "passphrase"
    secret = secrets.token_hex(16)
    passphrase.write_text(secret)
    passphrase.chmod(0o600)
    port = free_port()
    env = server_env(tmp / "root")
    env.pop("PERSISTING_MODELS")
    args = [sys.executable, "-m", "persisting.cli", "serve", "--storage-path", str(tmp / "root"),
            "--addr", f"127.0.0.1:{port}", "--passphrase", secret]  # fmt: skip
    log = tmp / "serve.log"
    proc = spawn(args, env, log)
    try:
        wait_for_log(log, "persisting: serving", proc)
        yield {
            "proc": proc,
            "root": tmp / "root",
            "cluster": {"seeds": [f"127.0.0.1:{port}"], "passphrase_file": str(passphrase)},
        }
    finally:
        kill_group(proc)
