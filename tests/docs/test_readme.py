"""README.md runs as written: its Python snippet runs as is in an empty folder, its LMCache
configuration is the one the user guide's test loads, and its two commands are the ones CI
and the guide use."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.docs_helpers import REPO, fenced_blocks, run_env

README = REPO / "README.md"
GUIDE = REPO / "docs" / "user-guide.md"


def readme_blocks(language: str) -> list[str]:
    return [b.code for b in fenced_blocks(README.read_text()) if b.language == language]


def test_the_using_it_snippet_runs_as_is(tmp_path: Path) -> None:
    (snippet,) = readme_blocks("python")
    script = tmp_path / "readme_snippet.py"
    script.write_text(snippet)
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    puts = [line for line in run.stdout.splitlines() if line.startswith("PutResult(")]
    assert len(puts) == 4 and all("tier='disk'" in line for line in puts)
    assert (work / "persisting-data" / "kv" / "meta-llama%2FLlama-3-8B").is_dir()


def test_the_snippet_says_a_partial_chunk_is_not_stored() -> None:
    text = README.read_text()
    assert "A trailing partial chunk" in text and "save_unfull_chunk=True" in text


def test_the_lmcache_keys_sit_under_extra_config_as_in_the_guide() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with LMCache's dependencies")
    (readme_yaml,) = [yaml.safe_load(code) for code in readme_blocks("yaml")]
    (guide_yaml,) = [
        yaml.safe_load(b.code)
        for b in fenced_blocks(GUIDE.read_text())
        if b.language == "yaml" and b.argument == "lmcache.yaml"
    ]
    top = set(readme_yaml)
    assert not {k for k in top if k.startswith(("storage_plugin.", "persisting."))}, top
    extra = readme_yaml["extra_config"]
    assert readme_yaml["storage_plugins"] == guide_yaml["storage_plugins"]
    for key in ("module_path", "class_name"):
        name = f"storage_plugin.PersistingBackend.{key}"
        assert extra[name] == guide_yaml["extra_config"][name]
    assert "persisting.storage_path" in extra
    # The plugin reads it without complaint (the guide's test loads it into LMCache).
    from persisting.lmcache_backend import settings_from_extra_config

    settings, _options = settings_from_extra_config(extra, readme_yaml["chunk_size"])
    assert str(settings.storage_path) == extra["persisting.storage_path"]


def test_the_two_commands_are_the_ones_ci_and_the_guide_run() -> None:
    commands = [line for code in readme_blocks("bash") for line in code.splitlines() if line]
    assert commands == [
        "bash scripts/install.sh && .venv/bin/persisting serve --model meta-llama/Llama-3-8B",
        "bash scripts/install.sh && .venv/bin/python -m pytest",
    ]
    # CI runs the test command's install, then the lint and type gates, then its pytest.
    ci = (REPO / ".ci" / "run").read_text()
    code = "\n".join(line for line in ci.splitlines() if not line.lstrip().startswith("#"))
    install, tests = commands[1].split(" && ")
    gates = [".venv/bin/ruff check .", ".venv/bin/ruff format --check .", ".venv/bin/mypy"]
    steps = [install, *gates, tests]
    assert all(step in code for step in steps), steps
    assert [code.index(step) for step in steps] == sorted(code.index(step) for step in steps)
    # serve's defaults make the first one work as typed: a model, the default root and addr.
    assert re.search(r"--model [\w./-]+$", commands[0])
