"""benchmarks/cold_reads.py and device_bench.py (``--device cpu``) run as users run them, at
tiny sizes: every row is there, positive and consistent. Their figures are not judged here
(the coordinator measures them on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{script}.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args, "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_cold_reads_measures_both_rows_in_alternating_rounds(tmp_path: Path) -> None:
    row = run(
        "cold_reads.py",
        *("--chunks", "3", "--shape", "2", "2", "16", "256", "--rounds", "2"),
        *("--settle-s", "0.05", "--dir", str(tmp_path)),
        tmp_path=tmp_path,
    )
    assert row["chunks"] == 3 and row["threads"] == 8 and row["rounds"] == 2
    for name in ("fresh_get", "fresh_raw", "open_s", "batched_get", "batched_raw"):
        assert len(row["all_rounds"][name]) == 2, name
        assert all(x > 0 for x in row["all_rounds"][name]), name
    for ratio in ("fresh_process_ratio", "batched_ratio"):
        assert row[ratio] > 0


def test_device_bench_runs_its_rows_on_cpu(tmp_path: Path) -> None:
    row = run(
        "device_bench.py",
        *("--device", "cpu", "--chunk-mib", "1", "--chunks", "2", "--rounds", "2"),
        *("--settle-s", "0.05", "--dir", str(tmp_path)),
        tmp_path=tmp_path,
    )
    assert row["device"] == "cpu"
    for ratio in ("memory_to_device", "sync_put_from_device", "cold_disk_to_device"):
        assert row[f"{ratio}_ratio"] > 0, ratio
    assert all(len(v) == 2 for v in row["all_rounds_gbps"].values())
