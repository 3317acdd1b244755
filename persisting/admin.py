"""Operator actions on a storage root, and a running server's figures read back from a scrape.

What ``persisting inspect | drop | compact | stats`` do, as plain functions returning
dataclasses; the CLI only renders them. Reading is side-effect free except where said:
:func:`model_stats` opens each model's KV store (which reconciles its metadata with its
payload files, as any open does).
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from persisting.config import PersistingSettings
from persisting.errors import (
    ConfigError,
    InvalidNameError,
    PersistingError,
    ProtocolError,
    ServiceUnavailableError,
)
from persisting.lance_store import LanceTable, StorageRoot, disk_usage, validate_name
from persisting.metrics import (
    LATENCY_METRIC,
    QUEUE_LAG_METRIC,
    STORE_FIGURES,
    TIERS,
    ConsumerLag,
    consumer_lags,
    figure_values,
)

#: The Lance metadata table inside a model's KV directory (see persisting.kv.disk_tier).
KV_METADATA = "meta.lance"
#: Errors a damaged or concurrently changed dataset may raise from Lance or the filesystem.
_DATASET_ERRORS = (PersistingError, OSError, ValueError, RuntimeError)


def open_root(path: str | Path) -> StorageRoot:
    """The storage root at ``path``; a path that does not exist is a ConfigError."""
    store = StorageRoot(path)
    if not store.root.is_dir():
        raise ConfigError(
            f"no storage root at {store.root} (check --storage-path or PERSISTING_STORAGE_PATH)"
        )
    return store


# ---------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    """One KV namespace: chunks (payload files, the durable record), bytes, metadata table."""

    model: str
    path: Path
    chunks: int
    bytes: int
    meta_rows: int | None
    meta_versions: int | None
    meta_fragments: int | None
    meta_bytes: int
    note: str | None = None


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
    from persisting.kv.payload_files import PayloadFiles

    path = store.kv_path(model)
    chunks = sum(1 for _ in PayloadFiles(path).scan())
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
    )


def inspect_bucket(store: StorageRoot, topic: str, bucket: int) -> BucketInfo:
    """Describe one queue bucket and the lag of its committed consumers, changing nothing."""
    from persisting.queue import open_bucket
    from persisting.queue.positions import ConsumerPositions

    bucket_dir = store.queue_bucket_dir(topic, bucket)
    size = disk_usage(bucket_dir)
    positions = ConsumerPositions(bucket_dir).all()
    table = store.existing_table(store.queue_path(topic, bucket))
    if table is None:
        lags = [ConsumerLag(topic, bucket, c, p, 0, 0) for c, p in sorted(positions.items())]
        note = "no flushed records yet (a live writer may hold some in its log)"
        return BucketInfo(topic, bucket, bucket_dir, 0, 0, 0, 0, 0, size, lags, note)
    backend = open_bucket(store.root, topic, bucket, read_only=True)
    try:
        first, end = backend.earliest_offset(), backend.total_count()
    finally:
        backend.close()
    lags = [
        ConsumerLag(topic, bucket, consumer, position, end, max(0, end - position))
        for consumer, position in sorted(positions.items())
    ]
    return BucketInfo(
        topic,
        bucket,
        bucket_dir,
        table.count_rows(),
        first,
        end,
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


# ---------------------------------------------------------------------------------------
# drop
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# compact
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# stats: figures from a storage root or from a scrape
# ---------------------------------------------------------------------------------------


@dataclass
class Latency:
    """One operation's latency, estimated from histogram buckets like PromQL's
    ``histogram_quantile`` (linear within a bucket)."""

    op: str
    tier: str
    outcome: str
    count: int
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


@dataclass
class ModelFigures:
    """A model's figures, named as in :data:`persisting.metrics.STORE_FIGURES`."""

    model: str
    figures: dict[str, Any]
    latency: list[Latency] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, **self.figures}
        out["latency"] = self.latency
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass
class StatsReport:
    source: str
    kind: Literal["storage_root", "metrics_url"]
    models: list[ModelFigures]
    queue_lag: list[ConsumerLag]

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "models": {m.model: m.to_dict() for m in self.models},
            "queue_lag": self.queue_lag,
        }


def figures_from_stats(model: str, stats: dict[str, Any]) -> ModelFigures:
    """A store's ``stats()`` as figures (the names the metrics use)."""
    figures = {}
    for figure in STORE_FIGURES:
        value = figure_values(figure, stats)
        if value is not None:
            figures[figure.field] = value
    return ModelFigures(model, figures)


def model_stats(
    store: StorageRoot, model: str, settings: PersistingSettings | None = None
) -> ModelFigures:
    """Open ``model``'s KV store (disk tier only, as configured) and read its figures.

    Counters are per process, so a store opened here shows what is stored (items, bytes,
    damage found while opening), not a server's traffic: scrape the server for that.
    """
    from persisting.kv import open_kv_store

    settings = settings or PersistingSettings.load()
    try:
        with open_kv_store(
            store.root, model, memory_bytes=0, durability="sync", settings=settings
        ) as kv:
            return figures_from_stats(model, kv.stats())
    except PersistingError as exc:
        return ModelFigures(model, {}, error=str(exc))


def root_stats(
    store: StorageRoot,
    settings: PersistingSettings | None = None,
    on_model: Callable[[], None] | None = None,
) -> StatsReport:
    models = []
    for model in store.list_models():
        models.append(model_stats(store, model, settings))
        if on_model is not None:
            on_model()
    return StatsReport(str(store.root), "storage_root", models, consumer_lags(store.root))


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The text of a Prometheus endpoint (ServiceUnavailableError if it cannot be read)."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"metrics URL must start with http:// or https://, got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8")
    except (urllib.error.URLError, OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ServiceUnavailableError(f"cannot scrape {url}: {reason}") from exc


def figures_from_scrape(text: str, source: str) -> StatsReport:
    """Read a scrape of :class:`~persisting.metrics.KVMetrics` back into figures."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    try:
        for family in text_string_to_metric_families(text):
            samples.extend(family.samples)
    except (ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"{source} did not return Prometheus text: {exc}") from exc
    names = {s.name for s in samples}
    ours = {f.sample_name for f in STORE_FIGURES} | {QUEUE_LAG_METRIC}
    if not names & ours:
        raise ProtocolError(f"{source} exports no Persisting metrics")

    by_name: dict[str, list[Any]] = defaultdict(list)
    for sample in samples:
        by_name[sample.name].append(sample)
    models: dict[str, ModelFigures] = {}

    def figures_of(model: str) -> ModelFigures:
        return models.setdefault(model, ModelFigures(model, {}))

    for figure in STORE_FIGURES:
        for sample in by_name.get(figure.sample_name, []):
            model = sample.labels.get("model", "")
            value = int(sample.value)
            if figure.per_tier:
                tiers = figures_of(model).figures.setdefault(figure.field, {})
                tiers[sample.labels.get("tier", "")] = value
            else:
                figures_of(model).figures[figure.field] = value
    for model, latencies in _latencies(by_name).items():
        figures_of(model).latency = latencies
    lags = [
        ConsumerLag(
            s.labels.get("topic", ""),
            int(s.labels.get("bucket", "0")),
            s.labels.get("consumer", ""),
            None,
            None,
            int(s.value),
        )
        for s in by_name.get(QUEUE_LAG_METRIC, [])
    ]
    for figures in models.values():  # same key order as a local report
        figures.figures = {
            f.field: _tier_order(figures.figures[f.field])
            for f in STORE_FIGURES
            if f.field in figures.figures
        }
    return StatsReport(source, "metrics_url", sorted(models.values(), key=_model), lags)


def _model(figures: ModelFigures) -> str:
    return figures.model


def _tier_order(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    return {t: value[t] for t in (*TIERS, *sorted(set(value) - set(TIERS))) if t in value}


def _latencies(by_name: dict[str, list[Any]]) -> dict[str, list[Latency]]:
    """Per model, one :class:`Latency` per (op, tier, outcome) that has observations."""
    series: dict[tuple[str, ...], dict[str, Any]] = defaultdict(
        lambda: {"buckets": [], "count": 0.0, "sum": 0.0}
    )
    for suffix in ("bucket", "count", "sum"):
        for sample in by_name.get(f"{LATENCY_METRIC}_{suffix}", []):
            labels = sample.labels
            key = (labels["model"], labels["op"], labels["tier"], labels["outcome"])
            if suffix == "bucket":
                series[key]["buckets"].append((float(labels["le"]), sample.value))
            else:
                series[key][suffix] = sample.value
    out: dict[str, list[Latency]] = defaultdict(list)
    for (model, op, tier, outcome), data in sorted(series.items()):
        count = int(data["count"])
        if count == 0:
            continue
        buckets = sorted(data["buckets"])
        out[model].append(
            Latency(
                op,
                tier,
                outcome,
                count,
                data["sum"] / count * 1000,
                *(_ms(histogram_quantile(q, buckets)) for q in (0.5, 0.95, 0.99)),
            )
        )
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(upper bound, count)`` buckets, as PromQL does it:
    linear interpolation inside the bucket the rank falls in (from 0 for the first bucket);
    a rank in the ``+Inf`` bucket gives the highest finite bound. None without observations.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


__all__ = [
    "KV_METADATA",
    "BucketInfo",
    "CompactionResult",
    "CompactionTarget",
    "DropResult",
    "Latency",
    "ModelFigures",
    "ModelInfo",
    "RootInfo",
    "StatsReport",
    "TopicInfo",
    "compact_dataset",
    "compaction_targets",
    "drop_model",
    "figures_from_scrape",
    "figures_from_stats",
    "histogram_quantile",
    "inspect_bucket",
    "inspect_model",
    "inspect_root",
    "model_stats",
    "open_root",
    "root_stats",
    "scrape",
]
