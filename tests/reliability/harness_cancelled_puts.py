"""Cancelled same-host puts never store another key's bytes.

    python -m tests.reliability.harness_cancelled_puts [--runs 100] [--json OUT]

One server process on loopback (``persisting serve``'s code path) and one same-host client
in this process. Each run starts 12 concurrent puts of 4 MiB values, cancels them after
30 ms, then makes 12 other puts at once, and reads every cancelled key back: a cancelled
key may be missing or hold its own value, never anything else. At the end the server is
restarted and every cancelled key of every run is read again, from disk.

Every byte of a value depends on its key, so a value stored under the wrong key is caught
whichever key's bytes it holds. Prints (and with ``--json`` writes) one JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.reliability.rel_common import emit
from tests.service.service_helpers import wait_for_log

REPO = Path(__file__).resolve().parents[2]
MODEL = "reliability/cancelled-puts"
VALUE_BYTES = 4 << 20
PUTS = 12
CANCEL_AFTER_S = 0.03


def key_text(run: int, i: int) -> str:
    return f"{MODEL}@1@0@{run * 1000 + i:x}@half"  # the values are float16


def value(run: int, i: int) -> np.ndarray:
    """4 MiB whose every 2-byte word depends on (run, i): no two keys share a word."""
    words = np.arange(VALUE_BYTES // 2, dtype=np.uint32)
    tag = (run * 1000 + i) * 7919
    bits = ((words * 40503 + tag) & 0xFFFF).astype(np.uint16).reshape(2, 16, 256, 256)
    return bits.view(np.float16)  # compared bit for bit (some words are NaNs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_server(root: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env.update(
        PYTHONPATH=str(REPO),
        PERSISTING_STORAGE_PATH=str(root),
        PERSISTING_MODELS=MODEL,
        PERSISTING_KV__MEMORY_BYTES=str(256 << 20),
        PERSISTING_KV__DISK_BYTES=str(1 << 30),
        PERSISTING_SERVICE__ADDR=f"127.0.0.1:{port}",
    )
    handle = open(log, "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.launch"],
        env=env,
        cwd=REPO,
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for_log(log, "persisting: serving", proc, timeout_s=90)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with_signal = signal.SIGINT
    try:
        os.killpg(proc.pid, with_signal)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with_signal = signal.SIGKILL
        try:
            os.killpg(proc.pid, with_signal)
        except ProcessLookupError:
            return
        proc.wait(timeout=30)


def _judge(got: Any, run: int, i: int) -> str:
    if got is None:
        return "missing"
    same = np.array_equal(np.asarray(got).view(np.uint16), value(run, i).view(np.uint16))
    return "own" if same else "wrong"


async def _run(root: Path, runs: int) -> dict[str, Any]:
    from persisting.config import PersistingSettings
    from persisting.service import KVCacheClient

    port = _free_port()
    settings = PersistingSettings(models=[MODEL], service={"request_timeout_s": 60.0})
    seeds = [f"127.0.0.1:{port}"]
    outcomes = {"own": 0, "missing": 0, "wrong": 0}
    wrong_runs = 0
    started = time.perf_counter()
    server = _start_server(root, port, root.parent / "server.log")
    try:
        client = await KVCacheClient.connect(seeds=seeds, model=MODEL, settings=settings)
        try:
            for run in range(runs):
                tasks = [
                    asyncio.create_task(client.put(key_text(run, i), value(run, i)))
                    for i in range(PUTS)
                ]
                await asyncio.sleep(CANCEL_AFTER_S)  # real duration: cancelled mid-put
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                others = [(key_text(run, PUTS + i), value(run, PUTS + i)) for i in range(PUTS)]
                await asyncio.gather(*(client.put(k, v) for k, v in others))
                wrong_before = outcomes["wrong"]
                for i in range(PUTS):
                    outcomes[_judge(await client.get(key_text(run, i)), run, i)] += 1
                wrong_runs += outcomes["wrong"] > wrong_before
            counters = dict(client.counters)
            served = next(iter((await client.stats())["members"].values()))["service"]
        finally:
            await client.close()
    finally:
        _stop(server)

    after = {"own": 0, "missing": 0, "wrong": 0}
    server = _start_server(root, port, root.parent / "server2.log")
    try:
        client = await KVCacheClient.connect(seeds=seeds, model=MODEL, settings=settings)
        try:
            for run in range(runs):
                for i in range(PUTS):
                    after[_judge(await client.get(key_text(run, i)), run, i)] += 1
        finally:
            await client.close()
    finally:
        _stop(server)
    return {
        "runs": runs,
        "cancelled_puts": runs * PUTS,
        "value_bytes": VALUE_BYTES,
        "cancel_after_ms": CANCEL_AFTER_S * 1000,
        "cancelled_keys_with_own_value": outcomes["own"],
        "cancelled_keys_missing": outcomes["missing"],
        "wrong_values": outcomes["wrong"],
        "runs_with_a_wrong_value": wrong_runs,
        "after_restart": after,
        "wrong_values_after_restart": after["wrong"],
        "client_counters": {
            k: v for k, v in counters.items() if k.startswith(("data_", "put_", "checksum"))
        },
        # Values whose bytes arrived damaged (the checksum after each payload): expected 0.
        "server_refused_damaged_values": served.get("put_damaged", 0),
        "server_errors": served.get("errors", 0),
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(runs: int = 100) -> dict[str, Any]:
    """Run the case ``runs`` times against one server; restart it and check again."""
    tmp = Path(tempfile.mkdtemp(prefix="cancelled-puts-"))
    try:
        return asyncio.run(_run(tmp / "root", runs))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    emit(run(args.runs), args.json)
    os._exit(0)  # Pulsing 0.1.2 may crash at interpreter exit after a shutdown


if __name__ == "__main__":
    main()
