"""``persisting stats``: a store's figures from a storage root, or a server's from a scrape."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from persisting.errors import ConfigError, ProtocolError, ServiceUnavailableError
from persisting.figures import (
    LATENCY_METRIC,
    QUEUE_LAG_METRIC,
    STORE_FIGURES,
    TIERS,
    ConsumerLag,
    consumer_lags,
    figure_values,
)
from persisting.lance_store import StorageRoot


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
    #: The namespace's owner record (a server, an LMCache L2 adapter with its capacity and
    #: last status), when one claimed it (see :mod:`persisting.lance_store.ownership`).
    owner: dict[str, Any] | None = None
    #: What the namespace holds in words, as its writers recorded it (engine, model,
    #: dtype, block size, layout, weights; see :mod:`persisting.kv.namespace.record`).
    describe: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, **self.figures}
        out["latency"] = self.latency
        if self.owner is not None:
            out["owner"] = self.owner
        if self.describe:
            out["describe"] = self.describe
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


def model_stats(store: StorageRoot, model: str) -> ModelFigures:
    """``model``'s stored figures, read from its files (:mod:`persisting.kv.namespace.survey`):
    nothing is opened for writing, evicted or rewritten, whatever this process's settings
    say. Its capacity is the one its writers recorded. Traffic counters live in the
    processes serving it: scrape them (``--metrics-url``) for those."""
    from persisting.kv.namespace.record import read_record
    from persisting.kv.namespace.survey import namespace_figures

    directory = store.kv_path(model)
    described = read_record(directory)
    # A served model's claim is under its name, its chunks in a namespace per weights.
    owner = store.model_owner(described.model if described is not None else model)
    record = owner.to_dict() if owner is not None else None
    try:
        figures = figures_from_stats(model, namespace_figures(directory))
    except OSError as exc:
        return ModelFigures(model, {}, error=f"cannot read {directory}: {exc}", owner=record)
    figures.owner = record
    if described is not None:
        figures.describe = described.describe
    return figures


def root_stats(store: StorageRoot, on_model: Callable[[], None] | None = None) -> StatsReport:
    models = []
    for model in store.list_models():
        models.append(model_stats(store, model))
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


#: The prefix of the figures an engine's connector exports (``persisting_vllm_<figure>``,
#: labelled by namespace: see persisting.integrations.vllm.metrics).
ENGINE_PREFIX = "persisting_vllm_"


def figures_from_scrape(text: str, source: str) -> StatsReport:
    """Read a scrape of :class:`~persisting.metrics.KVMetrics` back into figures, or of a
    vLLM engine's connector (its ``persisting_vllm_*`` figures, per namespace)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    try:
        for family in text_string_to_metric_families(text):
            samples.extend(family.samples)
    except (ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"{source} did not return Prometheus text: {exc}") from exc
    names = {s.name for s in samples}
    ours = {f.sample_name for f in STORE_FIGURES} | {QUEUE_LAG_METRIC, f"{LATENCY_METRIC}_count"}
    engine = [s for s in samples if s.name.startswith(ENGINE_PREFIX)]
    if not names & ours and not engine:
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
    for sample in engine:  # an engine's connector: its own figures, per namespace
        field = sample.name.removeprefix(ENGINE_PREFIX)
        if not field.endswith("_created"):
            model = sample.labels.get("namespace", "")
            figures_of(model).figures[field.removesuffix("_total")] = int(sample.value)
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
    for figures in models.values():  # same key order as a local report, then the engine's
        store = {f.field for f in STORE_FIGURES}
        figures.figures = {
            **{
                f.field: _tier_order(figures.figures[f.field])
                for f in STORE_FIGURES
                if f.field in figures.figures
            },
            **{k: v for k, v in figures.figures.items() if k not in store},
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
    "Latency",
    "ModelFigures",
    "StatsReport",
    "figures_from_scrape",
    "figures_from_stats",
    "histogram_quantile",
    "model_stats",
    "root_stats",
    "scrape",
]
