"""LMCache's multiprocess server with Persisting's L2 adapter, behind a real vLLM engine.

The recipe of docs/lmcache.md, run as written: ``lmcache server ... --l2-adapter
'{"type": "plugin", "module_path": "persisting.lmcache", "class_name":
"PersistingL2Adapter", ...}'`` and vLLM's ``LMCacheMPConnector``. An engine stores a
1,500-token prompt through the server; the server is SIGKILLed (its L1 memory is gone) and
started again; a new engine process reuses the prompt's prefix, found in Persisting.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.engines.engine_helpers import (
    ENGINE_VENV,
    build_model,
    engine_env,
    free_port,
    require_engine,
    run_engine,
    step,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPT = [1500, 1]
CHUNK = 256


def server_command(port: int, root: Path) -> list[str]:
    adapter = {
        "type": "plugin",
        "module_path": "persisting.lmcache",
        "class_name": "PersistingL2Adapter",
        "adapter_params": {"storage_path": str(root), "capacity": "1GiB"},
    }
    return [
        str(ENGINE_VENV / "bin" / "lmcache"),
        "server",
        "--host",
        "localhost",
        "--port",
        str(port),
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "1",
        "--eviction-policy",
        "LRU",
        "--supported-transfer-mode",
        "auto",
        "--l2-adapter",
        json.dumps(adapter),
        "--http-port",
        str(free_port()),
    ]


@contextmanager
def lmcache_server(port: int, root: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    require_engine()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            server_command(port, root), env=engine_env(), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"lmcache server exited {proc.returncode}:\n{log.read_text()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"lmcache server not listening:\n{log.read_text()}")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("lmcache-mp")
    model = build_model(work / "llama", layers=2, hidden=256)
    root = work / "root"
    port = free_port()
    plan = {
        "model": str(model),
        "max_model_len": 2048,
        "connector": {"kind": "lmcache", "port": port},
    }
    chunks = 1500 // CHUNK
    with lmcache_server(port, root, work / "server-1.log") as server:
        first = run_engine(
            {
                **plan,
                "steps": [
                    {"name": "prompt", "prompt": PROMPT, "max_tokens": 8},
                    {"action": "wait_files", "dir": str(root / "kv"), "count": chunks},
                ],
            },
            work,
            "first",
        )
        server.send_signal(signal.SIGKILL)  # L1 memory and every in-flight thing gone
        server.wait(timeout=30)
    with lmcache_server(port, root, work / "server-2.log"):
        second = run_engine(
            {**plan, "steps": [{"name": "prompt", "prompt": PROMPT, "max_tokens": 8}]},
            work,
            "second",
        )
    return {"first": first, "second": second, "log": (work / "server-2.log").read_text()}


def test_a_new_engine_reuses_the_prefix_after_the_server_was_killed(runs: dict[str, Any]) -> None:
    stored, restored = step(runs["first"], "prompt"), step(runs["second"], "prompt")
    assert stored["cached"] == 0
    assert restored["cached"] >= 1024
    assert restored["ids"] == stored["ids"]
