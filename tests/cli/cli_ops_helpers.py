"""Real stores and queue buckets for the operator-tool tests (inspect, compact, stats...)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from persisting.kv import ChunkKey, KVStore, open_kv_store
from persisting.queue import open_bucket

MODEL = "meta-llama/Llama-3-8B"
#: Bytes of one test value: 2 x 1 layer x 16 tokens x 64 hidden, bf16.
VALUE_BYTES = 2 * 1 * 16 * 64 * 2
#: Bytes one such value's payload file takes on disk (a 4 KiB header, page-rounded payload).
FILE_BYTES = 4096 + VALUE_BYTES


def key(i: int, model: str = MODEL) -> ChunkKey:
    return ChunkKey(model, 1, 0, i * 104_729 - 7, "bfloat16")


def value(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 1, 16, 64, generator=g).to(torch.bfloat16)


def open_store(root: Path, model: str = MODEL, **options: Any) -> KVStore:
    options.setdefault("memory_bytes", 1 << 20)
    options.setdefault("disk_bytes", 1 << 24)
    return open_kv_store(root, model, **options)


def fill(root: Path, model: str, count: int, *, batches: int = 1) -> None:
    """Store ``count`` chunks of ``model`` in ``batches`` puts (one metadata commit each)."""
    with open_store(root, model) as store:
        per = -(-count // batches)
        for start in range(0, count, per):
            ids = range(start, min(count, start + per))
            store.batched_put([key(i, model) for i in ids], [value(i) for i in ids])
            store.flush()


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int16), b.view(torch.int16))


def write_queue(
    root: Path,
    topic: str,
    bucket: int,
    records: int,
    *,
    flushes: int = 1,
    consumers: dict[str, int] | None = None,
) -> None:
    """Put ``records`` records into a real queue bucket in ``flushes`` flushes (one Lance
    fragment each) and commit ``consumers``' positions."""

    async def run() -> None:
        backend = open_bucket(root, topic, bucket, batch_size=1_000_000, flush_interval_s=0)
        try:
            per = -(-records // flushes)
            for start in range(0, records, per):
                await backend.put_batch(
                    [{"seq": i, "op": "prewarm"} for i in range(start, min(records, start + per))]
                )
                await backend.flush()
            for name, position in (consumers or {}).items():
                await backend.commit_position(name, position)
        finally:
            await backend.aclose()

    asyncio.run(run())


def read_queue(root: Path, topic: str, bucket: int) -> list[tuple[int, int]]:
    """Every record of a bucket as ``(offset, seq)``, read through a read-only backend."""

    async def run() -> list[tuple[int, int]]:
        backend = open_bucket(root, topic, bucket, read_only=True)
        try:
            start = backend.earliest_offset()
            records = await backend.get(backend.total_count() - start, start)
            return [(start + i, r["seq"]) for i, r in enumerate(records)]
        finally:
            await backend.aclose()

    return asyncio.run(run())
