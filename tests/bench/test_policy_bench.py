"""benchmarks/policy_bench.py runs as users run it, on a small trace: every row is there, the
store's replay agrees with the tier code it is checked against, the summary follows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests import child_env
from tests.bench.test_simulate import chains, plain_lru
from tests.cli.test_replay_blocks import mooncake

REPO = Path(__file__).resolve().parents[2]


def test_the_policy_bench_prints_every_row_and_the_summary(tmp_path: Path) -> None:
    trace = chains(4, 160)
    path = mooncake(tmp_path / "small.jsonl", trace)
    out = tmp_path / "policy.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "policy_bench.py"), "--trace", str(path),
         "--sizes", "5,20", "--store-sizes", "20", "--parts", "2,3", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["part"], r["blocks"]) for r in rows] == [
        (part, blocks)
        for part in ("whole", "1/2", "2/2", "1/3", "2/3", "3/3")
        for blocks in (5, 20)
    ]
    total = sum(len(r) for r in trace)
    whole = {r["blocks"]: r for r in rows if r["part"] == "whole"}
    assert whole[5]["lru"] == plain_lru(trace, 5)[0] / total
    assert whole[20]["via"].startswith("store")  # replayed through a real store
    tiers = float(whole[20]["via"].split("tiers ")[1].rstrip(")"))
    assert round(whole[20]["policy"], 4) == tiers  # and the tier code agrees with it
    ratios = [r["ratio"] for r in rows if r["lru"] > 0]
    assert data["geomean"] == math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert "geometric mean of value / LRU" in proc.stdout
