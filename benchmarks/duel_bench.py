"""Whether the ``value`` policy's duel earns its keep, on traces it was not tuned on.

    .venv/bin/python benchmarks/duel_bench.py [--trace conversation_trace.jsonl ...] \\
        [--generated] [--sizes 1000,3000] [--json out.json]

The duel (:class:`~persisting.kv.eviction.duel.RecencyDuel`) decides per tier whether the
``value`` policy weighs frequency (``always``) or evicts the oldest leaf (``never``). For
each workload and capacity in blocks this prints the token hit ratio of LRU, of ``value``
with frequency fixed off and fixed on, and of ``value`` with the duel choosing -- the tier
code fed one-byte entries, as ``policy_bench.py``'s ``via tiers`` rows. The duel earns its
keep where it is at least LRU and near the better of the two fixed choices on every row.

``--trace`` replays Mooncake-format traces (the duel's constants were chosen on Mooncake's
two public ones). ``--generated`` replays workloads made by ``persisting.bench.trace``'s
generator, which the constants never saw: Zipf-popular documents of 8 blocks with a unique
1-block suffix each, 10,000 requests, popularity fixed (``zipf``: frequency predicts reuse), uniform
(``uniform``: it predicts nothing) or moving to 200 new documents every 500 requests
(``bursty``: a document's count says how hot it was, not that it will come back).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from persisting.bench.mooncake import read_mooncake
from persisting.bench.simulate import lru_run, policy_run
from persisting.bench.trace import Segment, TraceRequest, TraceSpec, generate_trace
from persisting.kv.eviction.duel import RecencyDuel

BLOCK_TOKENS = 512
Requests = list[tuple[int, ...]]


@contextmanager
def frequency(weight: float | None) -> Iterator[None]:
    """Tiers made inside weigh frequency by ``weight`` always (None: the duel decides)."""
    if weight is None:
        yield
        return
    init, decide = RecencyDuel.__init__, RecencyDuel._decide

    def fixed_init(self: RecencyDuel, seed: int = 0) -> None:
        init(self, seed)
        self.weight = weight

    def fixed_decide(self: RecencyDuel) -> None:
        self.weight = weight

    RecencyDuel.__init__ = fixed_init  # type: ignore[method-assign]
    RecencyDuel._decide = fixed_decide  # type: ignore[method-assign]
    try:
        yield
    finally:
        RecencyDuel.__init__ = init  # type: ignore[method-assign]
        RecencyDuel._decide = decide  # type: ignore[method-assign]


def blocks_of(request: TraceRequest) -> tuple[int, ...]:
    """A generated request as prefix-chained block ids: block ``i`` is named by the
    segments its first ``(i + 1) x 512`` tokens are made of."""
    total = sum(s.tokens for s in request.segments)
    out = []
    for end in range(BLOCK_TOKENS, total + BLOCK_TOKENS, BLOCK_TOKENS):
        left, prefix = min(end, total), []
        for segment in request.segments:
            take = min(left, segment.tokens)
            prefix.append(f"{segment.id}:{take}")
            left -= take
            if not left:
                break
        out.append(xxhash.xxh3_64_intdigest("|".join(prefix).encode()))
    return tuple(out)


def generated() -> list[tuple[str, Requests]]:
    """The held-out workloads, 10,000 requests each (see the module's docstring)."""
    doc_tokens = 8 * BLOCK_TOKENS

    def spec(requests: int, documents: int, zipf_s: float, seed: int) -> TraceSpec:
        return TraceSpec(
            requests=requests,
            documents=documents,
            zipf_s=zipf_s,
            doc_tokens=doc_tokens,
            suffix_tokens=BLOCK_TOKENS,
            seed=seed,
        )

    zipf = generate_trace(spec(10_000, 2000, 0.9, 7))
    uniform = generate_trace(spec(10_000, 2000, 0.0, 8))
    bursty: Requests = []
    for phase in range(20):  # each stretch of 500 requests draws from documents of its own
        for request in generate_trace(spec(500, 200, 0.9, 100 + phase)).requests:
            doc = Segment(f"doc-{phase}-{request.meta['doc']}", doc_tokens)
            segments = (doc, request.segments[1])
            bursty.append(blocks_of(TraceRequest(request.id, request.t, segments=segments)))
    return [
        ("zipf", [blocks_of(r) for r in zipf.requests]),
        ("uniform", [blocks_of(r) for r in uniform.requests]),
        ("bursty", bursty),
    ]


def row(name: str, requests: Requests, blocks: int) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": name, "blocks": blocks}
    out["lru"] = lru_run(requests, blocks).token_hit_rate
    for label, weight in (("never", 0.0), ("always", 1.0), ("duel", None)):
        with frequency(weight):
            out[label] = policy_run(requests, blocks, "value").token_hit_rate
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, action="append", default=[])
    parser.add_argument("--generated", action="store_true")
    parser.add_argument("--sizes", default="1000,3000")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    workloads = [
        (path.stem.removesuffix("_trace"), [r.blocks for r in read_mooncake(path).requests])
        for path in args.trace
    ]
    if args.generated:
        workloads += generated()
    head = ("workload", "blocks", "LRU", "never", "always", "duel", "duel/LRU", "duel/best")
    print("{:14s} {:>7s} {:>7s} {:>7s} {:>7s} {:>7s} {:>8s} {:>9s}".format(*head))
    rows = []
    for name, requests in workloads:
        for blocks in sizes:
            r = row(name, requests, blocks)
            best = max(r["never"], r["always"])
            r["duel_over_lru"] = r["duel"] / r["lru"] if r["lru"] else 1.0
            r["duel_over_best"] = r["duel"] / best if best else 1.0
            rows.append(r)
            print(
                f"{name:14s} {blocks:7d} {r['lru']:7.4f} {r['never']:7.4f} {r['always']:7.4f} "
                f"{r['duel']:7.4f} {r['duel_over_lru']:8.3f} {r['duel_over_best']:9.3f}",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
