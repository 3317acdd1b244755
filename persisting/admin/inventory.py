"""``persisting inspect``: what a storage root holds, read without changing anything."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persisting.admin.root import _DATASET_ERRORS, KV_METADATA
from persisting.figures import ConsumerLag, bucket_offsets
from persisting.lance_store import StorageRoot, disk_usage


@dataclass
class ModelInfo:
    """One KV namespace: chunks (payload files, the durable record), bytes (allocated by
    every file of the namespace's directory, as ``du`` counts), metadata table, owner."""

    model: str
    path: Path
    chunks: int
    bytes: int
    meta_rows: int | None
    meta_versions: int | None
    meta_fragments: int | None
    meta_bytes: int
    note: str | None = None
    #: Who serves the namespace (a server, an LMCache L2 adapter): its claim record, with
    #: ``live`` and, for an adapter, its capacity and last status; None if never claimed.
    owner: dict[str, Any] | None = None
    #: The disk capacity its last writer configured (None: no writer recorded one).
    capacity: int | None = None
    #: What it holds in words, as its writers recorded it (engine, model, dtype, block
    #: size, layout, weights: see :mod:`persisting.kv.namespace.record`).
    describe: dict[str, Any] = field(default_factory=dict)
    #: Payload files the namespace's stores could not verify, set aside (never served).
    quarantined_files: int = 0
    quarantined_bytes: int = 0


@dataclass
class BucketInfo:
    """One queue bucket: records, offsets, Lance versions/fragments, bytes, consumers."""

    topic: str
    bucket: int
    path: Path
    rows: int
    first_offset: int
    end_offset: int
    fragments: int
    versions: int
    bytes: int
    consumers: list[ConsumerLag] = field(default_factory=list)
    note: str | None = None


@dataclass
class TopicInfo:
    topic: str
    rows: int
    bytes: int
    buckets: list[BucketInfo]


@dataclass
class RootInfo:
    root: Path
    bytes: int
    models: list[ModelInfo]
    topics: list[TopicInfo]


def inspect_model(store: StorageRoot, model: str) -> ModelInfo:
    """Count a model's payload files and describe its metadata table, changing nothing."""
    from persisting.kv.disk.payload_files import scan_payload
    from persisting.kv.disk.quarantine import Quarantine
    from persisting.kv.namespace.record import read_record

    path = store.kv_path(model)
    chunks = sum(1 for _ in scan_payload(path))
    meta_path = path / KV_METADATA
    rows = versions = fragments = None
    note = None
    try:
        table = store.existing_table(meta_path)
        if table is not None:
            rows, versions, fragments = (
                table.count_rows(),
                table.num_versions(),
                table.num_fragments(),
            )
    except _DATASET_ERRORS as exc:
        note = f"metadata table unreadable ({exc}); the next open rebuilds it from the files"
    if rows is not None and rows != chunks:
        note = (
            f"metadata lists {rows} chunk(s) for {chunks} payload file(s); "
            "the next open reconciles them (a live writer commits metadata in batches)"
        )
    record = read_record(path)
    # A served model's claim is under its name, its chunks in a namespace per weights.
    owner = store.model_owner(record.model if record is not None else model)
    return ModelInfo(
        model,
        path,
        chunks,
        store.model_bytes(model),
        rows,
        versions,
        fragments,
        disk_usage(meta_path) if meta_path.exists() else 0,
        note,
        owner.to_dict() if owner is not None else None,
        record.capacity if record is not None else None,
        record.describe if record is not None else {},
        *Quarantine(path, store.modes).summary(),
    )


def inspect_bucket(store: StorageRoot, topic: str, bucket: int) -> BucketInfo:
    """Describe one queue bucket and the lag of its committed consumers, changing nothing."""
    bucket_dir = store.queue_bucket_dir(topic, bucket)
    size = disk_usage(bucket_dir)
    table = store.existing_table(store.queue_path(topic, bucket))
    offsets = bucket_offsets(store, topic, bucket)
    lags = list(offsets.consumers)
    if table is None:
        note = "no flushed records yet (a live writer may hold some in its log)"
        return BucketInfo(topic, bucket, bucket_dir, 0, 0, 0, 0, 0, size, lags, note)
    return BucketInfo(
        topic,
        bucket,
        bucket_dir,
        table.count_rows(),
        offsets.first,
        offsets.end,
        table.num_fragments(),
        table.num_versions(),
        size,
        lags,
    )


def inspect_items(store: StorageRoot) -> tuple[list[str], list[tuple[str, int]]]:
    """The models and the ``(topic, bucket)`` pairs of a root (what inspect will visit)."""
    buckets = [(t, b) for t in store.list_topics() for b in store.list_buckets(t)]
    return store.list_models(), buckets


def inspect_root(store: StorageRoot, on_item: Callable[[], None] | None = None) -> RootInfo:
    """Every model and queue topic of a root; ``on_item`` is called after each one."""
    models, buckets = inspect_items(store)
    model_infos = []
    for model in models:
        model_infos.append(inspect_model(store, model))
        if on_item is not None:
            on_item()
    by_topic: dict[str, list[BucketInfo]] = defaultdict(list)
    for topic, bucket in buckets:
        by_topic[topic].append(inspect_bucket(store, topic, bucket))
        if on_item is not None:
            on_item()
    topics = [
        TopicInfo(t, sum(b.rows for b in bs), sum(b.bytes for b in bs), bs)
        for t, bs in by_topic.items()
    ]
    return RootInfo(store.root, disk_usage(store.root), model_infos, topics)


__all__ = [
    "BucketInfo",
    "ModelInfo",
    "RootInfo",
    "TopicInfo",
    "inspect_bucket",
    "inspect_items",
    "inspect_model",
    "inspect_root",
]
