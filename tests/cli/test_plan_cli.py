"""`persisting plan`: JSON for scripts, a table for people, clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persisting.cli import app

GiB = 1 << 30

SEED_ARGS = [
    "plan",
    "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
    "--prefix-tokens", "6144", "--prefixes", "1000", "--chunk-size", "256", "--tp", "4",
    "--replicas", "2", "--fill", "0.7", "--rps", "20", "--new-prefix-fraction", "0.1",
    "--new-prefix-tokens", "8192", "--staging-ms", "100", "--nic-gbps", "200",
    "--nic-efficiency", "0.7",
]  # fmt: skip

# The seed's worked example (section 1.2-1.3), worked by hand.
SEED_FIGURES = {
    "bytes_per_token": 131_072,
    "bytes_per_prefix": 805_306_368,
    "total_bytes": 750 * GiB,
    "replicated_bytes": 1500 * GiB,
    "pool_bytes": 2_300_875_337_143,
    "chunks_per_prefix": 24,
    "logical_chunks": 24_000,
    "objects": 96_000,
    "replica_records": 192_000,
    "bytes_per_object": 8 << 20,
    "read_bytes_per_s": 15 * GiB,
    "write_bytes_per_s": 4 * GiB,
    "lookups_per_s": 1920,
    "inflight_bytes": 3 * GiB // 2,
    "nic_usable_bytes_per_s": 17_500_000_000,
}

runner = CliRunner()


def test_plan_json_reproduces_the_seed_example() -> None:
    result = runner.invoke(app, [*SEED_ARGS, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for name, expected in SEED_FIGURES.items():
        assert data[name] == expected, name
        assert isinstance(data[name], int), name
    assert data["nic_headroom"] == pytest.approx(17.5e9 / (15 * GiB))
    assert data["inputs"]["fill"] == 0.7
    model = data["model"]
    assert {k: model[k] for k in ("layers", "kv_heads", "head_dim", "dtype")} == {
        "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"
    }  # fmt: skip
    assert model["objects_per_chunk"] == 4 and model["attention"] == "gqa"
    assert data["hardware"] is None and data["recompute"] is None
    assert data["warnings"] == [] and "what-if" in data["notes"][0]


def test_plan_json_for_an_mla_model() -> None:
    args = [
        "plan", "--bytes-per-token", "70272", "--prefix-tokens", "4096", "--prefixes", "500",
        "--replicas", "3", "--fill", "0.8", "--rps", "10", "--new-prefix-fraction", "0.25",
        "--staging-ms", "50", "--nic-gbps", "400", "--nic-efficiency", "0.8", "--json",
    ]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["pool_bytes"] == 539_688_960_000
    assert data["write_bytes_per_s"] == 2_158_755_840
    assert data["objects"] == 8_000
    assert data["model"]["attention"] == "given" and data["model"]["layers"] is None


def test_plan_table_shows_human_units_and_explains_each_line() -> None:
    result = runner.invoke(app, SEED_ARGS, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in (
        "128 KiB",
        "768 MiB",
        "750 GiB",
        "8 MiB",
        "15 GiB/s",
        "4 GiB/s",
        "1,920 /s",
        "1.5 GiB",
        "17.50 GB/s",
        "1.09x",
        "2,300,875,337,143 B",
        "prefixes x chunks per prefix",
        "usable NIC / read rate",
        "little room for bursts",
    ):
        assert text in out, text
    from persisting.planner import PLAN_LINES

    for line in PLAN_LINES:
        assert line.name in out
        assert line.meaning in out


def test_plan_table_warns_when_reads_exceed_the_nic() -> None:
    result = runner.invoke(
        app,
        [*SEED_ARGS, "--rps", "40"],
        env={"COLUMNS": "160"},
    )
    assert result.exit_code == 0, result.output
    assert "Reads alone exceed the usable NIC bandwidth" in result.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fill", "1.5"], "fill must be in (0, 1]"),
        (["--tp", "3"], "--tp=3 does not split --kv-heads=8 evenly"),
        (["--bytes-per-token", "4096"], "give either --bytes-per-token or the model shape"),
        (["--dtype", "int4"], "unknown --dtype 'int4'"),
        (["--head-dim", "0"], "--head-dim must be a whole number >= 1, got 0"),
        (["--model", "llama-3.1-8b"], "give --model or the shape, not both"),
        (["--head-dim", "576", "--kv-heads", "1"], "looks like an MLA latent"),
        (["--disk-bytes", "12XB"], "--disk-bytes must be a size"),
        (["--gpu", "h200"], "--gpu estimates the prefill rate of a --model preset"),
    ],
)
def test_plan_bad_input_is_a_one_line_error(extra: list[str], message: str) -> None:
    result = runner.invoke(app, [*SEED_ARGS, *extra, "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "Error:" in result.stderr
    assert result.stderr.count("\n") == 1  # one line, not wrapped, whatever its length
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_plan_needs_the_workload() -> None:
    result = runner.invoke(app, ["plan", "--layers", "32", "--kv-heads", "8"])
    assert result.exit_code == 2
    assert "--prefix-tokens" in result.output


@pytest.mark.timeout(120)
def test_installed_console_script_prints_json() -> None:
    script = Path(sys.executable).with_name("persisting")
    assert script.exists(), f"console script missing: {script}"
    proc = subprocess.run(
        [str(script), *SEED_ARGS, "--json"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for name, expected in SEED_FIGURES.items():
        assert data[name] == expected, name


PRESET_ARGS = ["plan", "--prefix-tokens", "4096", "--prefixes", "500", "--rps", "10"]


def test_presets_write_their_shapes_out_in_json() -> None:
    result = runner.invoke(app, [*PRESET_ARGS, "--model", "deepseek-v3", "--tp", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == {
        "name": "deepseek-v3",
        "hf_id": "deepseek-ai/DeepSeek-V3",
        "attention": "mla",
        "layers": 61,
        "kv_heads": 1,
        "head_dim": 576,
        "dtype": "bf16",
        "bytes_per_token": 70_272,
        "stored_bytes_per_token": 70_272,
        "objects_per_chunk": 1,
        "split_over_tp": False,
    }
    assert data["bytes_per_token"] == 70_272 and data["objects"] == 8_000
    assert data["inputs"]["model"] == "deepseek-v3" and data["inputs"]["tp"] == 8
    latent = runner.invoke(
        app, [*PRESET_ARGS, "--layers", "61", "--head-dim", "576", "--mla", "--json"]
    )
    assert json.loads(latent.stdout)["bytes_per_token"] == 70_272


def test_bytes_per_token_with_tp_is_never_split_silently() -> None:
    args = [*PRESET_ARGS, "--bytes-per-token", "70272", "--tp", "8"]
    refused = runner.invoke(app, [*args, "--json"])
    assert refused.exit_code == 2
    assert "--mla" in refused.stderr and "--no-mla" in refused.stderr
    once = json.loads(runner.invoke(app, [*args, "--mla", "--json"]).stdout)
    split = json.loads(runner.invoke(app, [*args, "--no-mla", "--json"]).stdout)
    assert once["objects"] == 8_000 and once["bytes_per_object"] == 256 * 70_272
    assert split["objects"] == 64_000 and split["bytes_per_object"] == 256 * 70_272 // 8


def test_hardware_and_recompute_tables_and_the_settings_to_use() -> None:
    args = [
        *PRESET_ARGS, "--model", "llama-3.1-8b", "--disk-bytes", "3.84TB",
        "--memory-bytes", "256GiB", "--disk-read", "1.2GB/s", "--disk-write", "1GB/s",
        "--prefill-tokens-per-s", "23000", "--new-prefix-fraction", "0.1",
    ]  # fmt: skip
    table = runner.invoke(app, args, env={"COLUMNS": "160"})
    assert table.exit_code == 0, table.output
    for text in (
        "Hardware (1 node(s))",
        "kv_disk_bytes",
        "set kv.disk_bytes to this",
        "[kv]",
        'disk_bytes = "2503GiB"',  # 3.84 TB x 0.7, rounded down
        'memory_bytes = "179GiB"',  # 256 GiB x 0.7, rounded down
        "Load or recompute",
        "break_even_bytes_per_s",
        "disk_vs_recompute",
        "0.40x",  # 1.2 GB/s against 23,000 x 128 KiB = 3.01 GB/s
        "equally popular",
    ):
        assert text in table.stdout, text
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert data["hardware"]["kv_disk_bytes"] == 2503 << 30
    assert data["recompute"]["break_even_bytes_per_s"] == 23_000 * 131_072


def test_warnings_and_notes_are_shown() -> None:
    result = runner.invoke(
        app,
        [*PRESET_ARGS, "--model", "qwen2.5-7b", "--tp", "8", "--replicas", "2"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "Warning: tp=8 exceeds kv_heads=4" in result.stdout
    assert "what-if for a replicated deployment" in result.stdout
