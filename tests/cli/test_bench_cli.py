"""`persisting bench generate | replay` end to end, on real stores under tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persisting.cli import app

runner = CliRunner()
SMALL_TRACE = ["--requests", "60", "--documents", "6", "--doc-tokens", "512", "--seed", "4"]
SMALL_TRACE += ["--suffix-tokens", "256"]
#: Small values, so a replay of the small trace takes a second: 1 KiB per token.
SMALL_VALUES = ["--bytes-per-token", "1024"]


def generate(tmp_path: Path) -> Path:
    trace = tmp_path / "trace.jsonl"
    result = runner.invoke(app, ["bench", "generate", str(trace), *SMALL_TRACE, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] == 60
    assert summary["tokens"] == 60 * (512 + 256)
    assert summary["distinct_documents"] <= 6
    assert summary["spec"]["seed"] == 4
    assert trace.exists()
    return trace


def test_generate_then_replay_reports_percentiles_and_writes_the_plot(tmp_path: Path) -> None:
    trace = generate(tmp_path)
    plot = tmp_path / "replay.png"
    result = runner.invoke(
        app, ["bench", "replay", str(trace), *SMALL_VALUES, "--plot", str(plot), "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["requests"] == 60
    assert data["chunks"] == 60 * 3  # 768 tokens = 3 chunks of 256
    # at most 6 documents: everything after each one's first sighting hits its 2 doc chunks
    assert data["hit_chunks"] >= (60 - 6) * 2
    assert data["hit_chunks"] == data["hit_tokens"] // 256
    assert data["bytes_read"] == data["hit_chunks"] * 256 * 1024
    assert data["mismatches"] == 0
    assert data["get_bytes_per_s"] > 0 and data["put_bytes_per_s"] > 0
    for op in ("lookup", "get", "put"):
        stats = data["ops"][op]
        assert stats["count"] > 0
        assert 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    assert data["plot"] == str(plot)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # every hit is split by tier; the local store's memory tier (settings: 2 GiB) holds all
    assert data["memory_hit_chunks"] + data["disk_hit_chunks"] == data["hit_chunks"]
    assert data["best_hit_tokens"] >= data["hit_tokens"]
    assert data["best_token_hit_rate"] == data["best_hit_tokens"] / data["tokens"]
    assert data["kv_model"] is None and data["bytes_per_token"] == 1024


def test_replay_table_and_a_kept_storage_root(tmp_path: Path) -> None:
    trace = generate(tmp_path)
    root = tmp_path / "root"
    first = runner.invoke(
        app, ["bench", "replay", str(trace), *SMALL_VALUES, "--storage-path", str(root)]
    )
    assert first.exit_code == 0, first.output
    for text in (
        "token hit rate",
        "best achievable",
        "hit chunks from memory",
        "values: 1 KiB/token",
        "bytes written",
        "get throughput",
        "p95",
        "p99",
        "lookup",
    ):
        assert text in first.stdout
    assert (root / "kv").is_dir()
    # the root is kept: a second replay finds every chunk the first one stored
    again = runner.invoke(
        app, ["bench", "replay", str(trace), *SMALL_VALUES, "--storage-path", str(root), "--json"]
    )
    assert again.exit_code == 0, again.output
    data = json.loads(again.stdout)
    assert data["chunk_hit_rate"] == 1.0
    assert data["bytes_written"] == 0


def test_replay_errors_are_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "something-else"}\n')
    result = runner.invoke(app, ["bench", "replay", str(bad)])
    assert result.exit_code == 2
    assert "Error:" in result.stderr and "header" in result.stderr
    assert "Traceback" not in result.output

    trace = generate(tmp_path)
    result = runner.invoke(
        app, ["bench", "replay", str(trace), *SMALL_VALUES, "--durability", "never"]
    )
    assert result.exit_code == 2
    assert "durability must be sync, async or write_back" in result.stderr

    result = runner.invoke(app, ["bench", "generate", str(tmp_path / "x.jsonl"), "--rate", "0"])
    assert result.exit_code == 2
    assert "rate must be > 0" in result.stderr


def test_help_lists_the_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "plan" in result.stdout and "bench" in result.stdout
    result = runner.invoke(app, ["bench", "--help"])
    assert "generate" in result.stdout and "replay" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_console_script_generates_replays_and_plots(tmp_path: Path) -> None:
    script = str(Path(sys.executable).with_name("persisting"))
    trace, plot = tmp_path / "t.jsonl", tmp_path / "p.png"

    def run(*args: str) -> str:
        proc = subprocess.run(
            [script, *args], capture_output=True, text=True, timeout=150, check=False
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    run("bench", "generate", str(trace), *SMALL_TRACE)
    out = run("bench", "replay", str(trace), *SMALL_VALUES, "--plot", str(plot))
    assert "p99" in out and "token hit rate" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_replay_into_another_model_namespace(tmp_path: Path) -> None:
    trace = generate(tmp_path)
    root = tmp_path / "root"
    args = ["bench", "replay", str(trace), *SMALL_VALUES, "--storage-path", str(root), "--json"]
    result = runner.invoke(app, [*args, "--model", "org/other-model", "--chunk-size", "128"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == "org/other-model"
    assert data["chunks"] == 60 * 6  # 768 tokens in chunks of 128
    namespaces = [p.name for p in (root / "kv").iterdir() if not p.name.startswith(".")]
    assert namespaces == ["org%2Fother-model"]  # the root's keys aside


def test_the_default_values_weigh_the_traces_model(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    tiny = ["--requests", "3", "--documents", "1", "--doc-tokens", "256", "--suffix-tokens", "8"]
    assert runner.invoke(app, ["bench", "generate", str(trace), *tiny]).exit_code == 0
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["model"] == "meta-llama/Llama-3.1-8B"
    result = runner.invoke(app, ["bench", "replay", str(trace), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kv_model"] == "llama-3.1-8b"
    assert data["bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # 128 KiB: the real model's KV
    assert data["chunk_bytes"] == 32 << 20
    assert data["bytes_written"] == 32 << 20 and data["bytes_read"] == 2 * (32 << 20)
    table = runner.invoke(
        app, ["bench", "replay", str(trace), "--kv-model", "qwen2.5-7b"], env={"COLUMNS": "200"}
    )
    assert "qwen2.5-7b KV: 56 KiB/token, 14 MiB chunks of 256 tokens" in table.stdout
    other = runner.invoke(app, ["bench", "replay", str(trace), "--model", "org/unknown"])
    assert other.exit_code == 2
    assert "no known KV size for 'org/unknown'" in other.stderr
