"""What Prometheus metrics cost a KV store, against the same store without them, same run.

    .venv/bin/python benchmarks/metrics_bench.py [--rounds 7] [--gets 2000] [--json out.json]

- warm gets from the memory tier (the cheapest operation, where a per-operation listener
  shows most) of 16 KiB and 8 MiB values, with a :class:`KVMetrics` attached vs detached,
  alternating rounds on one store; ratio = throughput with metrics / without (1.0 = free);
- durable puts of 16 KiB values, with vs without;
- one scrape (``KVMetrics.render``) with 1 and 16 attached stores, in milliseconds.

Figures are medians of the rounds (these machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from persisting.kv import ChunkKey, KVStore, open_kv_store
from persisting.metrics import KVMetrics

KiB, MiB = 1 << 10, 1 << 20


def key(model: str, i: int) -> ChunkKey:
    return ChunkKey(model, 1, 0, i * 1_000_003 - 7, "bfloat16")


def value(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, nbytes // 256, 64, generator=g).to(torch.bfloat16)


def timed_gets(store: KVStore, keys: list[ChunkKey], count: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        store.get(keys[i % len(keys)])
    return (time.perf_counter() - start) / count


def timed_puts(store: KVStore, values: list[torch.Tensor], first: int) -> float:
    start = time.perf_counter()
    for i, v in enumerate(values):
        store.put(key(store.model, first + i), v)
    return (time.perf_counter() - start) / len(values)


def get_overhead(root: Path, nbytes: int, gets: int, rounds: int) -> dict[str, float]:
    metrics = KVMetrics()
    with open_kv_store(root, f"bench/get-{nbytes}", memory_bytes=64 * MiB, disk_bytes=1 << 30) as s:
        keys = [key(s.model, i) for i in range(max(1, 32 * MiB // nbytes))]
        for i, k in enumerate(keys):
            s.put(k, value(nbytes, i))
        count = max(20, gets * 16 * KiB // nbytes)
        plain, instrumented = [], []
        for r in range(rounds):  # which goes first alternates, so drift favours neither
            for with_metrics in (r % 2 == 1, r % 2 == 0):
                if with_metrics:
                    metrics.attach(s)
                    instrumented.append(timed_gets(s, keys, count))
                    metrics.detach(s)
                else:
                    plain.append(timed_gets(s, keys, count))
    a, b = statistics.median(plain), statistics.median(instrumented)
    return {"bytes": nbytes, "plain_us": a * 1e6, "with_metrics_us": b * 1e6, "ratio": a / b}


def put_overhead(root: Path, puts: int, rounds: int) -> dict[str, float]:
    metrics = KVMetrics()
    nbytes = 16 * KiB
    with open_kv_store(root, "bench/put", memory_bytes=0, disk_bytes=1 << 30) as s:
        values = [value(nbytes, i) for i in range(puts)]
        plain, instrumented = [], []
        for r in range(rounds):
            for with_metrics in (r % 2 == 1, r % 2 == 0):
                first = (2 * r + with_metrics) * puts  # fresh keys: every put stores
                if with_metrics:
                    metrics.attach(s)
                    instrumented.append(timed_puts(s, values, first))
                    metrics.detach(s)
                else:
                    plain.append(timed_puts(s, values, first))
    a, b = statistics.median(plain), statistics.median(instrumented)
    return {"bytes": nbytes, "plain_us": a * 1e6, "with_metrics_us": b * 1e6, "ratio": a / b}


def scrape_ms(root: Path, stores: int, rounds: int) -> float:
    metrics = KVMetrics()
    opened = [
        open_kv_store(root, f"bench/scrape-{i}", memory_bytes=MiB, disk_bytes=64 * MiB)
        for i in range(stores)
    ]
    try:
        for s in opened:
            metrics.attach(s)
            s.put(key(s.model, 0), value(16 * KiB, 0))
            s.get(key(s.model, 0))
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            metrics.render()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000
    finally:
        for s in opened:
            metrics.detach(s)
            s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gets", type=int, default=2000, help="16 KiB gets per round")
    parser.add_argument("--puts", type=int, default=40, help="durable puts per round")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="persisting-metrics-bench-") as tmp:
        root = Path(tmp)
        results = {
            "gets": [get_overhead(root, n, args.gets, args.rounds) for n in (16 * KiB, 8 * MiB)],
            "puts": put_overhead(root, args.puts, args.rounds),
            "scrape_ms": {n: scrape_ms(root, n, args.rounds) for n in (1, 16)},
        }
    for g in results["gets"]:
        print(
            f"memory get {g['bytes'] // KiB:>5} KiB: {g['plain_us']:9.1f} us plain, "
            f"{g['with_metrics_us']:9.1f} us with metrics, ratio {g['ratio']:.3f}"
        )
    p = results["puts"]
    print(
        f"durable put   16 KiB: {p['plain_us']:9.1f} us plain, "
        f"{p['with_metrics_us']:9.1f} us with metrics, ratio {p['ratio']:.3f}"
    )
    for n, ms in results["scrape_ms"].items():
        print(f"scrape with {n:>2} store(s): {ms:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
