"""Several processes putting, getting, pinning and removing the same keys of one store
directory at once, bounded in time. Counts operations; fails on wrong data, on errors
other than the documented ones, and on a directory over its capacity.

    python -m tests.reliability.harness_kv_concurrency [--procs 4] [--seconds 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from persisting.errors import CapacityError
from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import file_size
from tests.reliability.rel_common import MODEL, emit, key_text, value

N_KEYS = 48
#: What a caller must be ready for under contention: a full tier whose every chunk is
#: pinned or being read by someone refuses a put with CapacityError.
DOCUMENTED = (CapacityError,)


def worker(root: str, seed: int, seconds: float, capacity: int, out: mp.Queue) -> None:
    rng = random.Random(seed)
    counts = {
        "put": 0,
        "get": 0,
        "hit": 0,
        "pin": 0,
        "unpin": 0,
        "remove": 0,
        "refresh": 0,
        "wrong": 0,
        "documented_errors": 0,
        "other_errors": 0,
    }
    pinned: list[str] = []
    with open_kv_store(root, MODEL, memory_bytes=4 << 20, disk_bytes=capacity) as store:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            i = rng.randrange(N_KEYS)
            op = rng.choice(("put", "put", "get", "get", "get", "pin", "remove", "refresh"))
            try:
                if op == "put":
                    store.put(key_text(i), value(i), fmt="KV_2TD")
                elif op == "get":
                    got = store.get(key_text(i))
                    if got is not None:
                        counts["hit"] += 1
                        if not np.array_equal(got, value(i)):
                            counts["wrong"] += 1
                elif op == "pin":
                    if store.pin(key_text(i)):
                        pinned.append(key_text(i))
                    if len(pinned) > 3:
                        store.unpin(pinned.pop(0))
                        counts["unpin"] += 1
                elif op == "remove":
                    store.remove(key_text(i), force=rng.random() < 0.5)
                else:
                    store.refresh()
                counts[op] += 1
            except DOCUMENTED:
                counts["documented_errors"] += 1
            except Exception as exc:
                counts["other_errors"] += 1
                print(f"worker {seed}: {type(exc).__name__}: {exc}", file=sys.stderr)
        for k in pinned:
            store.unpin(k)
    out.put(counts)


def run(procs: int, seconds: float, seed: int) -> dict:
    capacity = sum(file_size(value(i).nbytes) for i in range(N_KEYS)) // 2  # half the keys fit
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    peak = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        payload = root / "kv"
        ps = [
            ctx.Process(target=worker, args=(str(root), seed + w, seconds, capacity, results))
            for w in range(procs)
        ]
        for p in ps:
            p.start()
        end = time.monotonic() + seconds + 60
        while any(p.is_alive() for p in ps) and time.monotonic() < end:
            total = 0
            for f in payload.rglob("*.kv"):
                with contextlib.suppress(FileNotFoundError):
                    total += f.stat().st_size
            peak = max(peak, total)
            time.sleep(0.05)  # real duration: the peak sampled as the workers run
        counts = [results.get(timeout=60) for _ in ps]
        for p in ps:
            p.join(10)
            if p.is_alive():
                p.kill()
    totals = {k: sum(c[k] for c in counts) for k in counts[0]}
    ops = sum(totals[k] for k in ("put", "get", "pin", "unpin", "remove", "refresh"))
    largest = max(file_size(value(i).nbytes) for i in range(N_KEYS))
    return {
        "harness": "kv_concurrency",
        "processes": procs,
        "seconds": seconds,
        "operations": ops,
        **totals,
        "capacity_bytes": capacity,
        "peak_payload_bytes": peak,
        "capacity_held": peak <= capacity + largest * procs,
        "seed": seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.procs, args.seconds, args.seed)
    emit(result, args.json)
    ok = result["wrong"] == 0 and result["other_errors"] == 0 and result["capacity_held"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
