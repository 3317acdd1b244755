"""Attacks and careless use against the KV store, each tried ``--rounds`` times, counting
every bad outcome (issue 13's KV items): another user reading or stalling, a remove that
does not stick, a put result that lies, stores deleting each other's in-flight files, a
callback that kills the write-behind, a killed writer's reservation, ``du`` over the
budget, a drop under a live store.

    python -m tests.reliability.harness_kv_misuse [--rounds 5] [--json OUT]

Starts a process of another user (uid 65534) and so needs root; it fails, it does not
skip, without it.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from persisting.errors import NamespaceInUseError
from persisting.kv import KVStore, PutResult, open_kv_store
from persisting.kv.disk.payload_files import file_size
from persisting.lance_store import StorageRoot
from tests import child_env
from tests.reliability.rel_common import MODEL, emit, key_text, value
from tests.timing import finishes

MiB = 1 << 20
NOBODY = 65534
# The forked "other user" only makes system calls; Lance's fork warning does not apply.
warnings.filterwarnings("ignore", "lance is not fork-safe")


def _store(root: Path, **kw: Any) -> KVStore:
    kw.setdefault("memory_bytes", 0)
    kw.setdefault("disk_bytes", 64 * MiB)
    return open_kv_store(root, MODEL, **kw)


def foreign_user(base: Path) -> dict[str, int]:
    """Another local user tries to read every store file and to hold the lock."""
    root = base / "root"
    with _store(root) as store:
        for i in range(4):
            store.put(key_text(i), value(i, 64), fmt="KV_2TD")
        store.flush()
        files = [p for p in root.rglob("*") if p.is_file()]
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # only system calls in the child, then _exit
            code = 1
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                readable = 0
                for path in files:
                    try:
                        os.close(os.open(path, os.O_RDONLY))
                        readable += 1
                    except OSError:
                        pass
                try:
                    fd = os.open(store.directory / ".lock", os.O_RDONLY)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    locked = 1
                except OSError:
                    locked = 0
                os.write(write_end, f"{readable} {locked}\n".encode())
                signal.pause()  # holds the lock until the harness kills it
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end) as report:
            readable, locked = (int(x) for x in report.readline().split())
        stalled = not finishes(
            lambda: [store.put(key_text(i), value(i, 64), fmt="KV_2TD") for i in range(4, 8)]
        )
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return {
        "files_tried": len(files),
        "files_read": readable,
        "lock_taken": locked,
        "puts_stalled": int(stalled),
    }


def remove_during_write_behind(base: Path, n: int = 50) -> dict[str, int]:
    keys = [key_text(i) for i in range(n)]
    with _store(base, memory_bytes=64 * MiB, durability="async") as store:
        for i, k in enumerate(keys):
            store.put(k, value(i, 64), fmt="KV_2TD")
            store.remove(k)
        store.flush()
        back = sum(store.contains(k) for k in keys)
    with _store(base) as again:
        back_after_reopen = sum(again.contains(k) for k in keys)
    return {"removed": n, "back": back, "back_after_reopen": back_after_reopen}


def honest_put_results(base: Path) -> dict[str, int]:
    lies = 0
    for durability in ("async", "write_back"):
        one = value(0, 64).nbytes
        with _store(
            base / durability, memory_bytes=2 * one, disk_bytes=0, durability=durability
        ) as store:
            for i in (1, 2):
                store.put(key_text(i), value(0, 64), fmt="KV_2TD")
                store.pin(key_text(i))
            result = store.put(key_text(3), value(0, 64), fmt="KV_2TD")
            lies += int(result.stored and not store.contains(key_text(3)))
    return {"puts": 2, "stored_but_absent": lies}


def two_stores_one_directory(base: Path, n: int = 20) -> dict[str, int]:
    """Two stores of one process on one directory: one writes while the other keeps
    opening it (each open recounts usage, where in-flight files used to be deleted)."""
    failed = 0
    first = _store(base)
    try:

        def write() -> None:
            nonlocal failed
            for i in range(n):
                try:
                    first.put(key_text(i), block(i), fmt="KV_2TD")
                except Exception:
                    failed += 1

        writer = threading.Thread(target=write)
        writer.start()
        while writer.is_alive():
            with _store(base) as second:
                second.refresh()
        writer.join()
        missing = sum(not first.contains(key_text(i)) for i in range(n))
    finally:
        first.close()
    return {"puts": n, "failed": failed, "missing": missing}


def raising_callback(base: Path) -> dict[str, int]:
    def explode(_r: PutResult) -> None:
        raise RuntimeError("careless callback")

    durable: list[PutResult] = []
    store = _store(base, memory_bytes=64 * MiB, durability="async")
    store.put(key_text(1), value(1, 64), fmt="KV_2TD", on_complete=explode)
    hung = not finishes(store.flush)
    store.put(key_text(2), value(2, 64), fmt="KV_2TD", on_complete=durable.append)
    hung += not finishes(store.flush)
    hung += not finishes(store.close)
    return {"flush_or_close_hung": int(hung), "writes_after": int(bool(durable))}


def block(i: int) -> np.ndarray:
    return np.full((2, 8192, 64), i, dtype=np.float16)  # 2 MiB


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from tests.kv.kv_helpers import disk_tier
from tests.reliability.rel_common import MODEL, key_text
from persisting.kv import open_kv_store
store = open_kv_store(sys.argv[1], MODEL, memory_bytes=0, disk_bytes=int(sys.argv[2]))
files = disk_tier(store).files
real, done = files.publish, []
def finish(*args, **kwargs):
    if done:
        os.kill(os.getpid(), signal.SIGKILL)
    done.append(real(*args, **kwargs))
    return done[-1]
files.publish = finish
store.batched_put([key_text(100 + i) for i in range(8)],
                  [np.full((2, 8192, 64), 100 + i, np.float16) for i in range(8)], fmt="KV_2TD")
"""


def killed_writer(base: Path) -> dict[str, int]:
    """A writer SIGKILLed after one file of an 8-file batch: 6 + 8 + 4 files do not fit,
    6 + 1 + 4 do, so the survivor must reclaim the dead reservation rather than evict."""
    per_file = file_size(block(0).nbytes)
    capacity = 16 * per_file + (512 << 10)
    with _store(base, disk_bytes=capacity) as store:
        mine = [key_text(i) for i in range(10)]
        store.batched_put(mine[:6], [block(i) for i in range(6)], fmt="KV_2TD")
        subprocess.run(
            [
                sys.executable,
                "-c",
                KILLED_WRITER,
                str(base),
                str(capacity),
            ],
            env=child_env(),
            timeout=120,
        )
        store.batched_put(mine[6:], [block(i) for i in range(6, 10)], fmt="KV_2TD")
        reclaimed = store.stats()["reclaimed_bytes"]
        lost = sum(not store.contains(k) for k in mine)
    return {"dead_reservations": 7, "reclaimed": reclaimed // per_file, "over_evicted": lost}


def du_against_budget(base: Path) -> dict[str, int]:
    """Churn through a 4 MiB budget; ``du`` of the model directory after each flush."""
    capacity = 4 * MiB
    over = checks = worst = 0
    with _store(base, disk_bytes=capacity) as store:
        for i in range(160):
            store.put(key_text(i), value(i, 128), fmt="KV_2TD")
            if i % 16 == 15:
                store.flush()
                du = subprocess.run(
                    ["du", "-s", "--block-size=1", str(store.directory)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                checks += 1
                over += int(du.split()[0]) > capacity
                worst = max(worst, int(du.split()[0]))
    return {
        "checks": checks,
        "over_budget": over,
        "worst_du_kib": worst >> 10,
        "budget_kib": capacity >> 10,
    }


def drop_while_open(base: Path) -> dict[str, int]:
    with _store(base) as store:
        store.put(key_text(1), value(1, 64), fmt="KV_2TD")
        try:
            StorageRoot(base).drop_model(MODEL)
            refused = 0
        except NamespaceInUseError:
            refused = 1
        intact = int(store.get(key_text(1)) is not None)
    return {"drops_tried": 1, "refused": refused, "store_intact": intact}


ATTACKS = {
    "foreign_user": foreign_user,
    "remove_during_write_behind": remove_during_write_behind,
    "honest_put_results": honest_put_results,
    "two_stores_one_directory": two_stores_one_directory,
    "raising_callback": raising_callback,
    "killed_writer": killed_writer,
    "du_against_budget": du_against_budget,
    "drop_while_open": drop_while_open,
}


#: Figures that are a worst case or a setting, not a count to add up over rounds.
_NOT_SUMMED = {"worst_du_kib", "budget_kib"}


def run(rounds: int = 5) -> dict[str, Any]:
    assert os.geteuid() == 0, "this harness starts a process of another user: run it as root"
    start = time.monotonic()
    totals: dict[str, dict[str, int]] = {}
    for name, attack in ATTACKS.items():
        slot = totals.setdefault(name, {})
        for _ in range(rounds):
            with tempfile.TemporaryDirectory(prefix="persisting-misuse-") as tmp:
                Path(tmp).chmod(0o755)  # other users may enter, as they may enter /tmp
                for k, v in attack(Path(tmp)).items():
                    slot[k] = max(slot.get(k, 0), v) if k in _NOT_SUMMED else slot.get(k, 0) + v
    return {
        "harness": "kv_misuse",
        "rounds": rounds,
        "attacks": totals,
        "seconds": round(time.monotonic() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    emit(run(args.rounds), args.json)


if __name__ == "__main__":
    main()
