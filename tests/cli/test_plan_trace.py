"""``persisting plan --trace``: hit ratio against capacity for a workload's own requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persisting.cli import app
from tests.bench.test_simulate import chains, plain_lru, plain_min
from tests.cli.test_replay_blocks import mooncake

runner = CliRunner()
TRACE = chains(11, 200)
TOTAL = sum(len(r) for r in TRACE)


def plan(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_curve_is_the_policy_lru_and_min_at_each_capacity(tmp_path: Path) -> None:
    path = mooncake(tmp_path / "t.jsonl", TRACE)
    data = plan("--trace", str(path), "--capacities", "5,20,60")
    assert data["requests"] == 200 and data["block_references"] == TOTAL
    assert [p["capacity_blocks"] for p in data["points"]] == [5, 20, 60]
    for point in data["points"]:
        blocks = point["capacity_blocks"]
        assert point["lru_token_hit_rate"] == pytest.approx(plain_lru(TRACE, blocks)[0] / TOTAL)
        assert point["min_token_hit_rate"] == pytest.approx(plain_min(TRACE, blocks)[0] / TOTAL)
        assert 0 <= point["value_token_hit_rate"] <= 1
    default = plan("--trace", str(path))
    capacities = [p["capacity_blocks"] for p in default["points"]]
    assert capacities[-1] == default["distinct_blocks"] and len(capacities) > 4


def test_a_planners_budgets_are_blocks_of_the_model_and_cost_nothing(tmp_path: Path) -> None:
    path = mooncake(tmp_path / "t.jsonl", TRACE)
    png = tmp_path / "curve.png"
    data = plan("--trace", str(path), "--model", "llama-3.1-70b", "--tp", "8",
                "--memory-bytes", "1TB", "--disk-bytes", "8TB", "--gpu", "h100",
                "--disk-read", "7GB/s", "--plot", str(png))  # fmt: skip
    block = 512 * 327_680  # Llama-3.1-70B: 320 KiB of KV per token, all ranks
    assert data["block_bytes"] == block
    assert data["budget_blocks"]["memory"] == 10**12 // block
    assert data["budget_blocks"]["disk"] > data["budget_blocks"]["memory"]
    capacities = {p["capacity_blocks"] for p in data["points"]}
    assert set(data["budget_blocks"].values()) <= capacities
    top = data["points"][-1]
    assert top["capacity_bytes"] == top["capacity_blocks"] * block
    ttft = data["ttft"]
    assert ttft["estimated"] and ttft["prefill_tokens_per_s"] > 0
    # what a hit saves is what the planner's recompute and load prices say, per token
    per_token_ms = 1e3 / ttft["prefill_tokens_per_s"] - 1e3 * block / 512 / 7e9
    assert ttft["saving_ms_per_hit_token"] == pytest.approx(per_token_ms, rel=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_names_each_policy(tmp_path: Path) -> None:
    path = mooncake(tmp_path / "t.jsonl", TRACE)
    result = runner.invoke(app, ["plan", "--trace", str(path), "--capacities", "10,40"])
    assert result.exit_code == 0, result.output
    assert "value" in result.output and "LRU" in result.output and "MIN" in result.output


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--capacities", "ten"], "--capacities must be block counts"),
        (["--eviction", "fifo"], "unknown eviction policy"),
        (["--memory-bytes", "1TB"], "need the model"),
        (["--gpu", "h100"], "needs the model"),
    ],
)
def test_bad_trace_plans_are_one_line_errors(tmp_path: Path, extra: list[str], says: str) -> None:
    path = mooncake(tmp_path / "t.jsonl", TRACE)
    result = runner.invoke(app, ["plan", "--trace", str(path), *extra])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())
