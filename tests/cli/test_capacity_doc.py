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


def test_the_doc_has_the_worked_example_and_three_plans() -> None:
    plans = [argv for argv in commands() if argv[0] == "plan"]
    assert len(plans) == 3
    assert len(blocks("json")) == 1


def test_the_worked_example_prints_the_json_shown() -> None:
    shown = json.loads(blocks("json")[0])
    result = runner.invoke(app, commands()[0])
    assert result.exit_code == 0, result.output
    assert {k: v for k, v in json.loads(result.stdout).items() if k != "inputs"} == shown


def test_the_figures_quoted_for_other_shapes() -> None:
    mla, big = (argv for argv in commands()[1:] if argv[0] == "plan")
    data = json.loads(runner.invoke(app, mla).stdout)
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


@pytest.mark.timeout(120)
def test_the_bench_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    bench = [argv for argv in commands() if argv[0] == "bench"]
    assert [argv[1] for argv in bench] == ["generate", "replay"]
    for argv in bench:
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.output
    assert "p99" in result.stdout
    assert (tmp_path / "replay.png").read_bytes()[:4] == b"\x89PNG"
