"""Token hit ratio of the store's eviction policy against LRU (and MIN) on block traces.

    .venv/bin/python benchmarks/policy_bench.py --trace conversation_trace.jsonl \\
        --trace synthetic_trace.jsonl [--sizes 500,1000,2000,3000,5000,10000,20000,30000] \\
        [--parts 2,3] [--store-sizes 1000,3000,10000] [--eviction value] [--json out.json]

For each Mooncake-format trace (and, with ``--parts N``, its N parts cut at equal stretches
of its time span, each replayed cold; several counts comma-separated) and each capacity in
blocks, it prints the token hit
ratio of LRU and of Belady's MIN (``persisting.bench.simulate``: the references
``bench replay`` reports) and of the store's ``--eviction`` policy, and the ratio of the
policy to LRU, measured in the same run. At the ``--store-sizes`` the policy's figure
comes from a replay through a real store (a memory tier of that many 2 KiB blocks, the
calls ``persisting bench replay`` makes); at the others from the same tier and policy code
fed the same calls with one-byte entries (``policy_run``), which is what the store does
minus the bytes -- the rows replayed both ways show the two agree. The last lines give the
geometric mean of policy / LRU over the rows, the lowest ratio, and whether the policy is
at least LRU on every row of the whole traces (the rule for making it the default).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from persisting.bench.mooncake import BlockRequest, BlockTrace, read_mooncake
from persisting.bench.replay import ReplayOptions, replay_blocks
from persisting.bench.simulate import belady_run, lru_run, policy_run
from persisting.kv import open_kv_store

BYTES_PER_TOKEN = 4  # a 512-token block is 2 KiB: the store replays ~300k blocks in minutes


def cut(trace: BlockTrace, count: int) -> list[tuple[str, BlockTrace]]:
    """The trace in ``count`` parts (named ``"2/3"``: the second of three), cut at equal
    stretches of its time span."""
    if not trace.requests or count < 2:
        return []
    start, end = trace.requests[0].t, trace.requests[-1].t
    bounds = [start + (end - start) * i / count for i in range(1, count)]
    parts: list[list[BlockRequest]] = [[] for _ in range(count)]
    for request in trace.requests:
        parts[bisect.bisect_right(bounds, request.t)].append(request)
    return [
        (f"{i + 1}/{count}", BlockTrace(tuple(part), trace.block_tokens, trace.source))
        for i, part in enumerate(parts)
    ]


def store_rate(trace: BlockTrace, blocks: int, eviction: str) -> float:
    """The token hit ratio of a real store whose memory tier holds ``blocks`` blocks."""
    options = ReplayOptions(
        chunk_size=trace.block_tokens, bytes_per_token=BYTES_PER_TOKEN, verify=False
    )
    with tempfile.TemporaryDirectory(prefix="policy-bench-") as root:
        store = open_kv_store(
            root,
            "bench/trace",
            memory_bytes=blocks * options.chunk_bytes,
            disk_bytes=0,
            eviction=eviction,
        )
        try:
            result = replay_blocks(trace, store, options, model="bench/trace")
        finally:
            store.close()
    tokens = sum(r.tokens for r in result.records)
    return sum(r.hit_tokens for r in result.records) / tokens if tokens else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, action="append", required=True)
    parser.add_argument("--sizes", default="500,1000,2000,3000,5000,10000,20000,30000")
    parser.add_argument("--store-sizes", default="1000,3000,10000")
    parser.add_argument("--parts", default="", help="also cut each trace in N parts: 2,3")
    parser.add_argument("--eviction", default="value")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    store_sizes = {int(x) for x in args.store_sizes.split(",") if x}
    rows = []
    print(
        f"{'trace':28s} {'part':11s} {'blocks':>7s} {'LRU':>7s} {args.eviction:>7s} "
        f"{'MIN':>7s} {'ratio':>6s}  via"
    )
    for path in args.trace:
        whole = read_mooncake(path)
        counts = [int(x) for x in args.parts.split(",") if x]
        parts = [("whole", whole), *(p for n in counts for p in cut(whole, n))]
        for part, trace in parts:
            requests = [r.blocks for r in trace.requests]
            for blocks in sizes:
                start = time.perf_counter()
                lru = lru_run(requests, blocks).token_hit_rate
                best = belady_run(requests, blocks).token_hit_rate
                tiers = policy_run(requests, blocks, args.eviction).token_hit_rate
                via = "tiers"
                rate = tiers
                if part == "whole" and blocks in store_sizes:
                    rate = store_rate(trace, blocks, args.eviction)
                    via = f"store (tiers {tiers:.4f})"
                ratio = rate / lru if lru else 1.0
                row = {
                    "trace": path.name,
                    "part": part,
                    "blocks": blocks,
                    "lru": lru,
                    "policy": rate,
                    "min": best,
                    "ratio": ratio,
                    "via": via,
                    "seconds": time.perf_counter() - start,
                }
                rows.append(row)
                print(
                    f"{path.name:28s} {part:11s} {blocks:7d} {lru:7.4f} {rate:7.4f} "
                    f"{best:7.4f} {ratio:6.3f}  {via}",
                    flush=True,
                )
    ratios = [r["ratio"] for r in rows if r["lru"] > 0]
    geomean = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else 0.0
    named = [r for r in rows if r["part"] == "whole"]
    at_least_lru = all(r["policy"] >= r["lru"] for r in named)
    print(f"geometric mean of {args.eviction} / LRU over {len(ratios)} rows: {geomean:.3f}")
    print(f"lowest ratio: {min(ratios):.3f}" if ratios else "no rows")
    print(f"{args.eviction} >= LRU on every row of the whole traces: {at_least_lru}")
    if args.json is not None:
        summary = {"geomean": geomean, "at_least_lru": at_least_lru}
        args.json.write_text(json.dumps({"rows": rows, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
