"""``persisting drop | compact``: removing a model namespace, compacting Lance datasets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

from persisting.admin.inventory import inspect_model
from persisting.admin.root import _DATASET_ERRORS, KV_METADATA
from persisting.errors import InvalidNameError, NamespaceOwnedError
from persisting.lance_store import LanceTable, StorageRoot, disk_usage, validate_name


@dataclass
class DropResult:
    model: str
    path: Path
    chunks: int
    bytes: int
    dropped: bool


def drop_model(store: StorageRoot, model: str) -> DropResult:
    """Remove a model's namespace whole (what it held is reported); dropped=False if absent."""
    path = store.kv_path(model)
    if not path.exists():
        return DropResult(model, path, 0, 0, False)
    info = inspect_model(store, model)
    dropped = store.drop_model(model)
    return DropResult(model, path, info.chunks, info.bytes, dropped)


@dataclass(frozen=True)
class CompactionTarget:
    """A Lance dataset compaction may rewrite: a model's metadata or a queue bucket."""

    kind: Literal["kv", "queue"]
    name: str
    bucket: int | None
    path: Path


@dataclass
class CompactionResult:
    kind: Literal["kv", "queue"]
    name: str
    bucket: int | None
    path: Path
    bytes_before: int
    bytes_after: int
    fragments_before: int
    fragments_after: int
    versions_before: int
    versions_after: int
    removed_bytes: int
    error: str | None = None


def compaction_targets(
    store: StorageRoot, models: Sequence[str] = (), topics: Sequence[str] = ()
) -> list[CompactionTarget]:
    """The datasets to compact: of ``models`` and ``topics``, or of everything if both are
    empty. A named model or topic the root does not hold is an InvalidNameError."""
    everything = not models and not topics
    known_models, known_topics = store.list_models(), store.list_topics()
    for model in models:
        _require(model, known_models, "model", store)
    for topic in topics:
        _require(topic, known_topics, "topic", store)
    targets = [
        CompactionTarget("kv", m, None, store.kv_path(m) / KV_METADATA)
        for m in (known_models if everything else models)
    ]
    for topic in known_topics if everything else topics:
        targets.extend(
            CompactionTarget("queue", topic, b, store.queue_path(topic, b))
            for b in store.list_buckets(topic)
        )
    return [t for t in targets if t.path.exists()]


def refuse_live(store: StorageRoot, targets: Sequence[CompactionTarget]) -> None:
    """NamespaceOwnedError, naming the holder, if a targeted model is served now by a live
    server or L2 adapter: such an owner evicts and deletes from the metadata table while
    compaction rewrites it, so compaction waits until it is stopped. Namespaces that
    engines share through their own stores (no owner) compact beside them, as before;
    queue buckets compact under their writer lock."""
    for target in targets:
        if target.kind != "kv":
            continue
        owner = store.model_owner(target.name)
        if owner is not None and owner.live:
            error = NamespaceOwnedError(
                f"model {target.name!r} is served by {owner.describe()}; stop it before "
                "compacting the model, or compact only queue topics (--topic)"
            )
            error.holder = owner
            raise error


def _require(name: str, known: list[str], kind: str, store: StorageRoot) -> None:
    """InvalidNameError unless ``name`` is a valid name the root holds."""
    validate_name(name, kind)
    if name not in known:
        listed = ", ".join(known) or "none"
        raise InvalidNameError(f"no {kind} {name!r} under {store.root} ({kind}s: {listed})")


def compact_dataset(
    store: StorageRoot, target: CompactionTarget, older_than: timedelta
) -> CompactionResult:
    """Merge the dataset's fragments, then delete versions older than ``older_than`` (the
    newest is always kept). Failures (a damaged table, a conflicting concurrent commit) are
    reported in ``error``, not raised, so one bad dataset does not stop the others."""
    before = disk_usage(target.path)
    result = CompactionResult(
        target.kind, target.name, target.bucket, target.path, before, before, 0, 0, 0, 0, 0
    )
    try:
        table = store.existing_table(target.path)
        if table is None:
            result.error = "not a Lance dataset"
            return result
        result.fragments_before, result.versions_before = _shape(table)
        if target.kind == "queue":
            # Under the bucket's writer lock: a plain compaction beside a live writer's
            # appends would put rows out of offset order (refused while a writer runs).
            from persisting.queue import compact_bucket

            compact_bucket(target.path.parent, max_small=1, older_than_s=older_than.total_seconds())
            result.removed_bytes = max(0, before - disk_usage(target.path))
        else:
            table.compact()
            result.removed_bytes = table.cleanup(older_than, keep_versions=1)
        table.refresh()
        result.fragments_after, result.versions_after = _shape(table)
    except _DATASET_ERRORS as exc:
        result.error = str(exc) or type(exc).__name__
    result.bytes_after = disk_usage(target.path)
    return result


def _shape(table: LanceTable) -> tuple[int, int]:
    return table.num_fragments(), table.num_versions()


__all__ = [
    "CompactionResult",
    "CompactionTarget",
    "DropResult",
    "compact_dataset",
    "compaction_targets",
    "drop_model",
    "refuse_live",
]
