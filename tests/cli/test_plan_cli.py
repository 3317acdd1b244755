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
    assert data["inputs"]["model_shape"] == {
        "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"
    }  # fmt: skip


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
    assert data["inputs"]["model_shape"] is None


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
        (["--tp", "3"], "tp=3 does not split kv_heads=8 evenly"),
        (["--bytes-per-token", "4096"], "give either bytes_per_token or the model shape"),
        (["--dtype", "int4"], "unknown dtype 'int4'"),
        (["--head-dim", "0"], "head_dim must be a whole number >= 1, got 0"),
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
