"""A PNG of a replay: latency CDF per operation, and token hit rate over trace time.

Drawn with matplotlib's object API on the Agg canvas, so it needs no display and leaves
pyplot's global state alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from persisting.bench.replay import OPS, ReplayResult
from persisting.bench.report import hit_rate_over_time


def write_plot(result: ReplayResult, path: str | Path, bins: int = 20) -> Path:
    """Draw ``result`` into the PNG file ``path`` and return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
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

    ends, windowed, cumulative = hit_rate_over_time(result.records, bins=bins)
    hit_ax.plot(ends, windowed * 100, marker="o", markersize=3, label="per interval")
    hit_ax.plot(ends, cumulative * 100, linestyle="--", label="cumulative")
    hit_ax.set_xlabel("trace time (s)")
    hit_ax.set_ylabel("token hit rate (%)")
    hit_ax.set_ylim(0, 100)
    hit_ax.set_title("Hit rate over time")
    hit_ax.grid(True, alpha=0.3)
    hit_ax.legend(loc="lower right")

    fig.suptitle(f"{result.model} on {result.target}: {len(result.records)} requests")
    fig.savefig(path, dpi=100)
    return path


__all__ = ["write_plot"]
