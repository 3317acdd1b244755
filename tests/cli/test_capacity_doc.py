"""docs/capacity.md does not rot: its commands run and its JSON is what `plan` prints."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persisting.cli import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "capacity.md"
runner = CliRunner()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def commands() -> list[list[str]]:
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                argv = shlex.split(line)
                assert argv[0] == "persisting", line
                out.append(argv[1:])
    return out


def plans() -> list[list[str]]:
    """The budget plans (a plan from a trace runs with the bench commands, on its trace)."""
    return [argv for argv in commands() if argv[0] == "plan" and "--trace" not in argv]


def test_the_doc_has_the_worked_example_and_every_plan_runs() -> None:
    assert len(plans()) == 5
    assert len(blocks("json")) == 1
    for argv in plans():
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, (argv, result.output)


def test_the_worked_example_prints_the_json_shown() -> None:
    shown = json.loads(blocks("json")[0])
    result = runner.invoke(app, plans()[0])
    assert result.exit_code == 0, result.output
    assert {k: v for k, v in json.loads(result.stdout).items() if k != "inputs"} == shown


def test_the_figures_quoted_for_other_shapes() -> None:
    mla, big = plans()[1:3]
    data = json.loads(runner.invoke(app, mla).stdout)
    assert data["bytes_per_token"] == 70_272 and data["model"]["objects_per_chunk"] == 1
    assert data["pool_bytes"] == 539_688_960_000
    assert data["objects"] == 8_000 and data["bytes_per_object"] == 17_989_632
    assert data["read_bytes_per_s"] == 2_878_341_120
    assert round(data["nic_headroom"], 1) == 13.9
    table = runner.invoke(app, big, env={"COLUMNS": "160"})
    assert table.exit_code == 0, table.output
    assert "Reads alone exceed the usable NIC bandwidth" in table.stdout
    data = json.loads(runner.invoke(app, [*big, "--json"]).stdout)
    assert round(data["pool_bytes"] / (1 << 30), 1) == 13_333.3
    assert data["objects"] == 256_000 and data["bytes_per_object"] == 20 << 20
    assert round(data["nic_headroom"], 2) == 0.52


def test_the_figures_quoted_for_the_hardware_and_recompute() -> None:
    hardware, recompute = plans()[3:5]
    table = runner.invoke(app, hardware, env={"COLUMNS": "160"})
    assert 'disk_bytes = "5006GiB"' in table.stdout
    assert 'memory_bytes = "179GiB"' in table.stdout
    hw = json.loads(runner.invoke(app, [*hardware, "--json"]).stdout)["hardware"]
    assert hw["file_bytes_per_object"] == 8_392_704
    assert hw["disk_bytes_per_node"] == 402_849_792_000
    assert (hw["prefixes_on_disk"], hw["prefixes_in_memory"]) == (13_342, 477)
    assert round(hw["memory_read_share"], 3) == 0.477
    assert hw["disk_read_bytes_per_s"] == 4_211_752_305
    assert round(hw["disk_read_headroom"], 2) == 2.85
    assert hw["disk_write_bytes_per_s"] == 1 << 30
    assert round(hw["disk_write_headroom"], 2) == 5.59
    assert (round(hw["max_rps"], 1), hw["max_rps_limit"]) == (43.5, "NIC")
    r = json.loads(runner.invoke(app, recompute).stdout)["recompute"]
    assert r["break_even_bytes_per_s"] == 3_014_656_000
    assert round(r["disk_vs_recompute"], 2) == 0.40
    assert (round(r["disk_load_ms"] / 1000, 2), round(r["recompute_ms"] / 1000, 2)) == (3.58, 1.42)
    assert round(r["nic_vs_recompute"], 1) == 5.8
    estimate = [a for a in recompute if a != "--json"]
    at = estimate.index("--prefill-tokens-per-s")
    estimate[at : at + 2] = ["--gpu", "h200"]
    r = json.loads(runner.invoke(app, [*estimate, "--json"]).stdout)["recompute"]
    assert r["prefill_tokens_per_s"] == 20_060


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.bench.test_simulate import chains
    from tests.cli.test_replay_blocks import mooncake

    monkeypatch.chdir(tmp_path)
    mooncake(tmp_path / "conversation_trace.jsonl", chains(2, 400))  # a stand-in, same format
    runs = [argv for argv in commands() if argv[0] == "bench" or "--trace" in argv]
    assert [argv[1] for argv in runs] == ["generate", "replay", "generate", "--trace", "replay"]
    out = []
    for argv in runs:
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, (argv, result.output)
        out.append(result.stdout)
    assert "p99" in out[1]
    assert (tmp_path / "replay.png").read_bytes()[:4] == b"\x89PNG"
    assert "Token hit ratio against capacity" in out[3]
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads(out[4])
    assert data["capacity_blocks"] == 1000 and data["format"] == "mooncake"
    assert {"lru_token_hit_rate", "belady_token_hit_rate"} <= set(data)
