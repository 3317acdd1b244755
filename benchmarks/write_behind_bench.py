"""Cold reads beside a write-behind burst, against the same reads alone (issue 38, item 3).

    .venv/bin/python benchmarks/write_behind_bench.py [--cold 24] [--burst 64] [--mib 8]
        [--rounds 3] [--settle-s 5] [--json out.json]

One store (``durability="async"``, a memory tier the size of one burst, 8 read threads)
holds ``--cold`` values of ``--mib`` MiB on disk only (written, flushed, then pushed out
of memory; page cache dropped before every timed read). Each round times one
``batched_get`` of those cold values twice, the order alternating:

- ``alone``: nothing queued for disk;
- ``beside``: right after ``--burst`` async puts of new values (acknowledged from memory),
  so the store's write-behind writes and fsyncs them while the reads run.

Per round it also reports how long the burst took to be durable (``drain_s``: from the
last put returning to ``flush()`` returning, the flush itself waiting at normal priority).
Rows: GB/s of the reads (medians over rounds) and ``beside / alone`` (median of per-round
ratios; 1.0 means the write-behind cost the reads nothing). The disk is settled
(``os.sync()`` and ``--settle-s``) before every timed phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cold_reads

from persisting.kv import ChunkKey, KVStore, open_kv_store

MODEL = "bench/write-behind"
MiB = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, i * 1_000_003 - 7, "bfloat16")


def value(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, nbytes // (2 * 8 * 1024 * 2), 1024, generator=g).to(torch.bfloat16)


def drop_cache(store: KVStore, keys: list[ChunkKey]) -> None:
    paths = [where.path for k in keys if (where := store.lease(k, 0.0)) is not None]
    assert len(paths) == len(keys), "a cold value is not on disk"
    cold_reads.drop_cache(paths)


def timed_read(store: KVStore, keys: list[ChunkKey], nbytes: int) -> float:
    """GB/s of one batched_get of ``keys`` (all must hit)."""
    start = time.perf_counter()
    got = store.batched_get(keys)
    seconds = time.perf_counter() - start
    assert all(g is not None for g in got), "a cold read missed"
    return len(keys) * nbytes / seconds / 1e9


def run(args: argparse.Namespace, work: Path) -> dict:
    nbytes = args.mib * MiB
    burst_values = [value(nbytes, 10_000 + i) for i in range(args.burst)]
    cold = [key(i) for i in range(args.cold)]
    rows: dict[str, list[float]] = {"alone": [], "beside": [], "ratio": [], "drain_s": []}
    with open_kv_store(
        work / "root",
        MODEL,
        memory_bytes=args.burst * nbytes,
        disk_bytes=(args.cold + args.burst * (args.rounds + 2)) * nbytes * 2,
        durability="async",
        read_threads=8,
    ) as store:
        for i, k in enumerate(cold):
            store.put(k, value(nbytes, i))
        store.flush()
        for r in range(-1, args.rounds):  # round -1 pushes the cold values out of memory
            burst = [key(1_000 + (r + 1) * args.burst + i) for i in range(args.burst)]
            if r < 0:
                for k, v in zip(burst, burst_values, strict=True):
                    store.put(k, v)
                store.flush()
                assert not any(store.in_memory(k) for k in cold)
                continue
            got: dict[str, float] = {}
            for phase in ("alone", "beside") if r % 2 == 0 else ("beside", "alone"):
                if phase == "beside":
                    # New values land in memory (pushing the cold ones out of it, if still
                    # there) and queue for the write-behind; settled first, then the reads.
                    cold_reads.settle(args.settle_s)
                    drop_cache(store, cold)
                    for k, v in zip(burst, burst_values, strict=True):
                        store.put(k, v)
                    put_end = time.perf_counter()
                    got[phase] = timed_read(store, cold, nbytes)
                    store.flush()
                    rows["drain_s"].append(time.perf_counter() - put_end)
                else:
                    cold_reads.settle(args.settle_s)
                    drop_cache(store, cold)
                    got[phase] = timed_read(store, cold, nbytes)
            for phase in ("alone", "beside"):
                rows[phase].append(got[phase])
            rows["ratio"].append(got["beside"] / got["alone"])
            print(
                f"round {r}: alone {got['alone']:.3f} GB/s, beside {got['beside']:.3f} GB/s "
                f"({got['beside'] / got['alone']:.2f}x), burst durable after "
                f"{rows['drain_s'][-1]:.2f} s (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        stats = store.stats()
    return {
        "alone_gbps": round(statistics.median(rows["alone"]), 3),
        "beside_gbps": round(statistics.median(rows["beside"]), 3),
        "beside_vs_alone": round(statistics.median(rows["ratio"]), 3),
        "drain_s": round(statistics.median(rows["drain_s"]), 2),
        "rounds": rows,
        "writer_handovers": stats.get("writer_handovers"),
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cold", type=int, default=24, help="values read cold per phase")
    parser.add_argument("--burst", type=int, default=64, help="values put before 'beside'")
    parser.add_argument("--mib", type=int, default=8, help="MiB per value")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = run(args, Path(tmp))
    print(
        f"cold batched_get of {args.cold} x {args.mib} MiB: alone {result['alone_gbps']:.3f} "
        f"GB/s, beside a write-behind of {args.burst} x {args.mib} MiB "
        f"{result['beside_gbps']:.3f} GB/s -> {result['beside_vs_alone']:.2f}x (median of "
        f"per-round ratios); burst durable after {result['drain_s']:.2f} s",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
