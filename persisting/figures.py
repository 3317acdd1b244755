"""The figures a KV store and a queue expose, named once for every reader.

:data:`STORE_FIGURES` maps each figure's report name to its Prometheus metric and the
``KVStore.stats()`` key behind it; the exporter (:mod:`persisting.metrics`), ``persisting
stats`` and its scrape reader all go through it. Queue consumer lag is worked out here too
(:func:`bucket_offsets`, :func:`consumer_lags`), in one place for ``inspect``, ``stats``
and the exporter. Nothing here imports prometheus_client, so the command line can read
figures without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from persisting.lance_store import StorageRoot

#: The tiers a figure may be broken down by (the ``tier`` label).
TIERS = ("memory", "disk")

LATENCY_METRIC = "persisting_kv_operation_seconds"
QUEUE_LAG_METRIC = "persisting_queue_consumer_lag"


@dataclass(frozen=True)
class StoreFigure:
    """One figure of a KV store: its name in reports, its metric, and its ``stats()`` key.

    A ``key`` containing ``{tier}`` is one sample per tier (label ``tier``); counters are
    exported with Prometheus' ``_total`` suffix after ``metric``.
    """

    field: str
    metric: str
    kind: Literal["counter", "gauge"]
    key: str
    help: str

    @property
    def per_tier(self) -> bool:
        return "{tier}" in self.key

    @property
    def sample_name(self) -> str:
        """The name a scrape shows (counters carry ``_total``)."""
        return f"{self.metric}_total" if self.kind == "counter" else self.metric


STORE_FIGURES: tuple[StoreFigure, ...] = (
    StoreFigure("hits", "persisting_kv_hits", "counter", "get_hit_{tier}", "Gets served, by tier."),
    StoreFigure(
        "misses",
        "persisting_kv_misses",
        "counter",
        "get_miss",
        "Gets that returned nothing: absent, wrong layout, damaged or evicted mid-read.",
    ),
    StoreFigure(
        "hit_tokens",
        "persisting_kv_hit_tokens",
        "counter",
        "lookup_hit_tokens",
        "Tokens covered by stored chunks, summed over token lookups.",
    ),
    StoreFigure(
        "lookup_hit_chunks",
        "persisting_kv_lookup_hit_chunks",
        "counter",
        "lookup_hit_chunks",
        "Leading chunks found present, summed over prefix lookups.",
    ),
    StoreFigure(
        "read_bytes",
        "persisting_kv_read_bytes",
        "counter",
        "get_bytes_{tier}",
        "Payload bytes returned by gets, by the tier that served them.",
    ),
    StoreFigure(
        "written_bytes",
        "persisting_kv_written_bytes",
        "counter",
        "put_bytes_{tier}",
        "Payload bytes newly stored by puts, by the tier the put completed in.",
    ),
    StoreFigure(
        "disk_written_bytes",
        "persisting_kv_disk_written_bytes",
        "counter",
        "disk_written_bytes",
        "Bytes of payload files this process wrote to the disk tier (headers and block "
        "rounding included): what admission saves.",
    ),
    StoreFigure(
        "put_requests",
        "persisting_kv_put_requests",
        "counter",
        "put_stored_{tier}",
        "Put calls (a batch counts once), by the tier they completed in.",
    ),
    StoreFigure(
        "evictions",
        "persisting_kv_evictions",
        "counter",
        "{tier}_evictions",
        "Chunks evicted to make room, by tier.",
    ),
    StoreFigure(
        "corruptions",
        "persisting_kv_corruptions",
        "counter",
        "corruptions",
        "Damaged payloads or metadata detected (dropped, never returned).",
    ),
    StoreFigure(
        "layout_mismatches",
        "persisting_kv_layout_mismatches",
        "counter",
        "layout_mismatches",
        "Gets whose stored layout differed from the one asked for (served as misses).",
    ),
    StoreFigure(
        "prefetched",
        "persisting_kv_prefetched",
        "counter",
        "prefetched",
        "Chunks found in memory after prefetch requests.",
    ),
    StoreFigure(
        "writeback_failures",
        "persisting_kv_writeback_failures",
        "counter",
        "writeback_failures",
        "Write-behind disk writes that failed (the value stayed memory-only).",
    ),
    StoreFigure(
        "writeback_dropped",
        "persisting_kv_writeback_dropped",
        "counter",
        "writeback_dropped",
        "Dirty chunks evicted from memory that the full disk tier could not take.",
    ),
    StoreFigure(
        "recovered_files",
        "persisting_kv_recovered_files",
        "counter",
        "recovered_files",
        "Payload files found on open that the metadata did not know (adopted).",
    ),
    StoreFigure(
        "foreign_files",
        "persisting_kv_foreign_files",
        "counter",
        "foreign_files",
        "Payload files found that no store of this storage root wrote (quarantined, never served).",
    ),
    StoreFigure(
        "quarantined_files",
        "persisting_kv_quarantined_files",
        "counter",
        "quarantined_files",
        "Payload files this store moved to its namespace's quarantine (unverifiable: never"
        " served, never deleted but by the operator).",
    ),
    StoreFigure(
        "restored_files",
        "persisting_kv_restored_files",
        "counter",
        "restored_files",
        "Quarantined payload files put back at open because they verify again.",
    ),
    StoreFigure(
        "load_plan_load_tokens",
        "persisting_kv_load_plan_load_tokens",
        "counter",
        "load_plan_load_tokens",
        "Hit tokens a load-or-recompute plan chose to load, summed over plans.",
    ),
    StoreFigure(
        "load_plan_recompute_tokens",
        "persisting_kv_load_plan_recompute_tokens",
        "counter",
        "load_plan_recompute_tokens",
        "Hit tokens a load-or-recompute plan left to recompute (slower to read than to "
        "prefill), summed over plans.",
    ),
    StoreFigure(
        "read_bandwidth",
        "persisting_kv_read_bandwidth_bytes_per_second",
        "gauge",
        "read_bandwidth_{tier}",
        "Read bandwidth gets achieved lately, by tier (a moving average; 0 before the "
        "tier's first read).",
    ),
    StoreFigure("items", "persisting_kv_items", "gauge", "{tier}_items", "Chunks held, by tier."),
    StoreFigure(
        "bytes",
        "persisting_kv_bytes",
        "gauge",
        "{tier}_bytes",
        "Bytes in use, by tier (disk: the model directory, shared by all its processes).",
    ),
    StoreFigure(
        "capacity",
        "persisting_kv_capacity_bytes",
        "gauge",
        "{tier}_capacity",
        "Configured budget, by tier.",
    ),
    StoreFigure(
        "pending_puts",
        "persisting_kv_pending_puts",
        "gauge",
        "pending_puts",
        "Write-behind puts not yet durable on disk.",
    ),
    StoreFigure(
        "pending_bytes",
        "persisting_kv_pending_bytes",
        "gauge",
        "pending_bytes",
        "Bytes acknowledged but not yet durable on disk (bounded by kv.write_behind_bytes).",
    ),
)


def figure_values(figure: StoreFigure, stats: Mapping[str, Any]) -> dict[str, int] | int | None:
    """``figure``'s value in a ``stats()`` dict: per tier as a dict, else one number.

    Counters a store never incremented are 0; a gauge of a tier the store lacks (no disk
    tier) is left out, and None if the store has no such gauge at all.
    """
    if figure.per_tier:
        values: dict[str, int] = {}
        for tier in TIERS:
            key = figure.key.format(tier=tier)
            if key in stats or figure.kind == "counter":
                values[tier] = int(stats.get(key, 0))
        return values or None
    if figure.key in stats or figure.kind == "counter":
        return int(stats.get(figure.key, 0))
    return None


# ---------------------------------------------------------------------------------------
# Queue consumer lag
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConsumerLag:
    """How far one committed consumer of a queue bucket is behind the bucket's end
    (``position`` and ``end_offset`` are None where only the lag is known, as in a scrape)."""

    topic: str
    bucket: int
    consumer: str
    position: int | None
    end_offset: int | None
    lag: int


@dataclass(frozen=True)
class BucketOffsets:
    """A bucket's flushed offsets (``first`` still stored, ``end`` next to be written) and
    the lag of each committed consumer against ``end``."""

    first: int
    end: int
    consumers: tuple[ConsumerLag, ...]


def bucket_offsets(store: StorageRoot, topic: str, bucket: int) -> BucketOffsets:
    """Offsets and consumer lags of one bucket, read through a read-only queue backend.

    Records still in a live writer's buffer or log are not counted; a bucket with no
    flushed records has ``first == end == 0``.
    """
    from persisting.queue import open_bucket
    from persisting.queue.positions import ConsumerPositions

    positions = ConsumerPositions(store.queue_bucket_dir(topic, bucket)).all()
    first = end = 0
    if store.queue_path(topic, bucket).exists():
        backend = open_bucket(store.root, topic, bucket, read_only=True)
        try:
            first, end = backend.earliest_offset(), backend.total_count()
        finally:
            backend.close()
    lags = tuple(
        ConsumerLag(topic, bucket, consumer, position, end, max(0, end - position))
        for consumer, position in sorted(positions.items())
    )
    return BucketOffsets(first, end, lags)


def consumer_lags(
    storage_root: str | os.PathLike[str], topics: Sequence[str] | None = None
) -> list[ConsumerLag]:
    """The lag of every committed consumer under ``storage_root`` (of ``topics``, or all)
    whose bucket has flushed records."""
    from persisting.queue.positions import ConsumerPositions

    store = StorageRoot(storage_root)
    out: list[ConsumerLag] = []
    for topic in topics if topics is not None else store.list_topics():
        for bucket in store.list_buckets(topic):
            committed = ConsumerPositions(store.queue_bucket_dir(topic, bucket)).all()
            if committed and store.queue_path(topic, bucket).exists():
                out.extend(bucket_offsets(store, topic, bucket).consumers)
    return out


__all__ = [
    "LATENCY_METRIC",
    "QUEUE_LAG_METRIC",
    "STORE_FIGURES",
    "TIERS",
    "BucketOffsets",
    "ConsumerLag",
    "StoreFigure",
    "bucket_offsets",
    "consumer_lags",
    "figure_values",
]
