"""PNGs: a replay's latency CDF per operation and token hit rate over trace time (split
into memory-tier and disk-tier hits, against the best rate an unbounded cache reaches); and
a trace's hit ratio against capacity for a policy, LRU and the offline optimum.

Drawn with matplotlib's object API on the Agg canvas, so it needs no display and leaves
pyplot's global state alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from persisting.bench.replay import OPS, ReplayResult
from persisting.bench.report import hit_rates_over_time, summarize

if TYPE_CHECKING:
    from persisting.bench.curve import CurvePoint, TierBlocks


def values_caption(result: ReplayResult) -> str:
    """What the stored values weigh, e.g. ``llama-3.1-8b KV: 128 KiB/token, 32 MiB chunks``."""
    options = result.options
    per_token = _binary(options.bytes_per_token)
    chunk = _binary(options.bytes_per_token * options.chunk_size)
    model = f"{options.kv_model} KV" if options.kv_model else "values"
    return f"{model}: {per_token}/token, {chunk} chunks of {options.chunk_size} tokens"


def _binary(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def write_plot(result: ReplayResult, path: str | Path, bins: int = 20) -> Path:
    """Draw ``result`` into the PNG file ``path`` and return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    cdf_ax, hit_ax = fig.subplots(1, 2)

    for op in OPS:
        samples = np.sort(np.asarray(result.latencies_s.get(op, []), dtype=np.float64)) * 1e3
        if samples.size:
            fraction = np.arange(1, samples.size + 1) / samples.size
            cdf_ax.step(samples, fraction, where="post", label=f"{op} (n={samples.size})")
    cdf_ax.set_xscale("log")
    cdf_ax.set_xlabel("latency per request (ms, log scale)")
    cdf_ax.set_ylabel("fraction of requests")
    cdf_ax.set_ylim(0, 1.02)
    cdf_ax.set_title("Latency CDF")
    cdf_ax.grid(True, which="both", alpha=0.3)
    if cdf_ax.lines:
        cdf_ax.legend(loc="lower right")

    rates = hit_rates_over_time(result.records, bins=bins)
    report = summarize(result)
    if rates.split:
        hit_ax.stackplot(
            rates.ends,
            rates.memory * 100,
            rates.disk * 100,
            labels=["memory-tier hits", "disk-tier hits"],
            colors=["tab:green", "tab:orange"],
            alpha=0.7,
            step="pre",
        )
    else:
        hit_ax.plot(rates.ends, rates.memory * 100, marker="o", markersize=3, label="per interval")
    hit_ax.plot(rates.ends, rates.cumulative * 100, color="black", label="cumulative")
    hit_ax.plot(
        rates.ends,
        rates.best_cumulative * 100,
        color="tab:blue",
        linestyle="--",
        label="best achievable (cold, unbounded cache), cumulative",
    )
    hit_ax.axhline(
        report.best_token_hit_rate * 100,
        color="tab:blue",
        linestyle=":",
        label=f"best over the trace: {report.best_token_hit_rate:.0%}",
    )
    hit_ax.set_xlabel("trace time (s)")
    hit_ax.set_ylabel("token hit rate (%)")
    hit_ax.set_ylim(0, 100)
    hit_ax.set_title("Hit rate over time")
    hit_ax.grid(True, alpha=0.3)
    hit_ax.legend(loc="lower right", fontsize="small")

    fig.suptitle(
        f"{result.model} on {result.target}: {len(result.records)} requests; "
        f"{values_caption(result)}"
    )
    fig.savefig(path, dpi=100)
    return path


def write_curve_plot(
    points: Sequence[CurvePoint],
    path: str | Path,
    *,
    eviction: str,
    budgets: TierBlocks | None = None,
    title: str = "",
) -> Path:
    """Token hit ratio against capacity (log scale) for ``eviction``, LRU and MIN, with the
    memory and disk budgets marked when given; written to the PNG file ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    x = [p.capacity_blocks for p in points]
    styles = {eviction: ("tab:green", "-"), "lru": ("tab:orange", "--"), "min": ("gray", ":")}
    labels = {eviction: f"store: {eviction}", "lru": "LRU", "min": "MIN (offline optimum)"}
    for name, (color, line) in styles.items():
        ys = [p.policies[name] * 100 for p in points]
        ax.plot(x, ys, color=color, linestyle=line, marker="o", markersize=3, label=labels[name])
    if budgets is not None:
        for blocks, what in ((budgets.memory, "memory budget"), (budgets.disk, "disk budget")):
            if blocks > 0:
                ax.axvline(blocks, color="tab:blue", alpha=0.4, linestyle="-.", label=what)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks, log scale)")
    ax.set_ylabel("token hit ratio (%)")
    ax.set_ylim(0, max(5.0, max((p.policies["min"] for p in points), default=0) * 110))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(f"Hit ratio against capacity{': ' + title if title else ''}")
    fig.savefig(path, dpi=100)
    return path


__all__ = ["values_caption", "write_curve_plot", "write_plot"]
