"""benchmarks/ttft_bench.py --tiny: the whole TTFT benchmark on a tiny model on CPU, run as
users run it; its figures are not judged here, only that they are there and consistent."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATHS = ("memory_get", "memory_ring", "disk_get", "disk_ring")


@pytest.mark.slow
def test_the_tiny_ttft_run_restores_bit_exact_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ttft_bench.py"), "--tiny", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-exact: True" in proc.stdout
    report = json.loads(out.read_text())
    assert report["tiny"] is True and report["device"] == "cpu" and report["skipped"] == []
    (model,) = report["models"]
    assert model["model"] == "tiny"
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 heads of 16, fp32
    assert [row["prefix"] for row in model["rows"]] == [256, 512]
    for row in model["rows"]:
        assert row["suffix"] == 16 and row["full_s"] > 0 and row["save_s"] > 0
        assert row["raw_h2d_gbps"] > 0
        for path in PATHS:
            figures = row[path]
            assert figures["bit_exact"] is True, path
            assert figures["tokens"] == row["prefix"], path
            assert figures["ttft_s"] > figures["suffix_s"] > 0, path
            assert math.isclose(figures["ttft_cut"], 1 - figures["ttft_s"] / row["full_s"])
            assert figures["restore_gbps"] > 0 and figures["vs_raw_h2d"] > 0
        for path in ("memory_get", "disk_get"):
            parts = sum(row[path][k] for k in ("lookup_s", "get_s", "h2d_s", "build_s", "suffix_s"))
            assert math.isclose(parts, row[path]["ttft_s"])
        decision = row["load_or_recompute"]
        assert decision["disk_gbps"] > 0 and decision["prefill_tokens_per_s"] > 0
        assert decision["choice"] == ("load" if decision["load_tokens"] else "recompute")
        assert decision["load_tokens"] in (0, row["prefix"])
        if decision["choice"] == "recompute":
            assert decision["ttft_s"] == row["full_s"] and decision["never_worse"] is True
