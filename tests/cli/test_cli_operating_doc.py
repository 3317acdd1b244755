"""docs/operating.md does not rot: its shell and Python blocks run, in order, against a fresh
storage root, and every metric its tables and PromQL name is one the exporter serves."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from persisting.metrics import (
    LATENCY_METRIC,
    QUEUE_LAG_METRIC,
    SERVICE_METRICS,
    STORE_FIGURES,
    KVMetrics,
)
from tests.cli.cli_ops_helpers import key, open_store, value
from tests.docs.docs_helpers import fenced_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "operating.md"


def blocks(language: str) -> list[str]:
    """The doc's blocks in ``language``, less those marked ``<!-- no-test: why -->``
    (installing a service, building an image: tests/docs/test_deploy.py checks those)."""
    return [
        block.code
        for block in fenced_blocks(DOC.read_text())
        if block.language == language and block.marker != "no-test"
    ]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, KVMetrics]]:
    """A live metrics endpoint over a real store that has seen traffic and a queue lag."""
    metrics = KVMetrics()
    store = open_store(tmp_path / "served-root")
    metrics.attach(store)
    store.put(key(1), value(1))
    store.get(key(1))
    store.get(key(2))
    metrics.set_queue_lag("kv-events", 0, "prewarm", 3)
    metrics.track_service(  # what a server exports about itself
        lambda: {
            "requests": {"get": 2},
            "errors": {"invalid_value": 1},
            "sessions": 1,
            "members_up": 1,
            "ready": True,
            "consumer": {
                "topic": "kv-events",
                "consumer": "kv-service/kvstore",
                "position": {"0": 3},
                "applied": 3,
            },
        }
    )
    server = metrics.serve()
    yield server.url, metrics
    server.close()
    metrics.detach(store)
    store.close()


def shell_env(metrics_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["METRICS_URL"] = metrics_url
    env["COLUMNS"] = "160"
    return env


def shims(env: dict[str, str]) -> str:
    """Shell functions for `persisting` and `python` when this interpreter's directory lacks
    them (pytest run by a Python other than the project's virtualenv)."""
    out = ""
    if shutil.which("persisting", path=env["PATH"]) is None:
        out += f'persisting() {{ "{sys.executable}" -m persisting.cli "$@"; }}\n'
    if shutil.which("python", path=env["PATH"]) is None:
        out += f'python() {{ "{sys.executable}" "$@"; }}\n'
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_shell_blocks_run_in_order(tmp_path: Path, served: tuple[str, KVMetrics]) -> None:
    url, _metrics = served
    shell = blocks("bash")
    assert len(shell) == 7
    env = shell_env(url)
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shims(env) + "\n".join(shell)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    inventory = json.loads((tmp_path / "inventory.json").read_text())
    (model,) = inventory["models"]
    assert model["model"] == "demo/llama" and model["chunks"] > 0
    assert Path(inventory["root"]) == (tmp_path / "ops-demo").resolve()
    lines = run.stdout.splitlines()
    assert str(model["chunks"]) in lines  # the one-liner printed stats' disk items
    assert f"server metrics at {url}" in run.stdout and "Latency of" in run.stdout
    compaction = json.loads((tmp_path / "compaction.json").read_text())
    assert [(d["kind"], d["name"], d["error"]) for d in compaction["datasets"]] == [
        ("kv", "demo/llama", None)
    ]
    assert "demo/llama: 0 file(s)" in run.stdout  # nothing quarantined
    assert "Dropped demo/llama" in run.stdout
    assert lines[-1].endswith("0 model(s), 0 queue topic(s).")  # the last inspect
    assert not (tmp_path / "ops-demo" / "kv" / "demo%2Fllama").exists()


@pytest.mark.timeout(120)
def test_the_python_blocks_run(tmp_path: Path) -> None:
    python = blocks("python")
    assert python
    for block in python:
        run = subprocess.run(
            [sys.executable, "-c", block],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=110,
        )
        assert run.returncode == 0, run.stdout + run.stderr


def test_every_metric_is_documented_and_every_documented_metric_exists(
    served: tuple[str, KVMetrics],
) -> None:
    _url, metrics = served
    text = DOC.read_text()
    table = set(re.findall(r"^\| `(persisting_[a-z_]+)` \|", text, flags=re.M))
    exported = {f.sample_name for f in STORE_FIGURES} | {LATENCY_METRIC, QUEUE_LAG_METRIC}
    exported |= set(SERVICE_METRICS)
    assert table == exported
    served_names = {
        line.split("{")[0].split(" ")[0]
        for line in metrics.render().splitlines()
        if line.startswith("persisting_")
    }
    promql = blocks("promql")
    assert len(promql) == 3
    used = set(re.findall(r"persisting_[a-z_]+", "".join(promql)))
    assert used and used <= served_names, used - served_names


def test_every_file_a_namespace_keeps_is_in_the_files_table(tmp_path: Path) -> None:
    """The table of a namespace's files names every entry a store leaves in its directory."""
    text = DOC.read_text()
    section = text[text.index("### A namespace's files") : text.index("## Figures")]
    named = {
        name.split("/")[0] + ("/" if "/" in name else "")
        for row in re.findall(r"^\| (`[^|]+`) \|", section, flags=re.M)
        for name in re.findall(r"`([^`]+)`", row)
    }
    root = tmp_path / "files-root"
    with open_store(root) as store:
        store.put(key(1), value(1))
        store.get(key(1))
        store.flush()
    (namespace,) = (d for d in (root / "kv").iterdir() if not d.name.startswith("."))
    found = {e.name + ("/" if e.is_dir() else "") for e in namespace.iterdir()}
    assert found, "the store left nothing to check"
    assert found <= named, found - named
