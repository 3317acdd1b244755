"""A namespace says what it holds: its writers record the model, their capacity and what
they know of the KV; `persisting inspect` and `stats` show it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from persisting.errors import ConfigError
from persisting.kv import open_kv_store
from persisting.kv.namespace.record import read_record

NS = "vllm.tiny.0123456789abcdef"
ABOUT = {"engine": "vllm", "model": "/models/tiny", "dtype": "bfloat16", "block_size": 16}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "persisting.cli", *args],
        env={**os.environ, "COLUMNS": "250"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_the_record_says_what_the_namespace_holds(root: Path) -> None:
    with open_kv_store(root, NS, memory_bytes=0, disk_bytes="4MiB", describe=ABOUT) as store:
        store.put(f"{NS}@1@0@1@bfloat16", b"x" * 100, fmt="binary")
    record = read_record(root / "kv" / NS)
    assert record is not None
    assert (record.model, record.capacity, record.describe) == (NS, 4 << 20, ABOUT)
    # A writer that says nothing keeps the description; its capacity is the one recorded.
    with open_kv_store(root, NS, memory_bytes=0, disk_bytes="8MiB"):
        pass
    record = read_record(root / "kv" / NS)
    assert record is not None and (record.capacity, record.describe) == (8 << 20, ABOUT)

    shown = json.loads(run_cli("inspect", "--storage-path", str(root), "--json").stdout)
    (model,) = shown["models"]
    assert (model["capacity"], model["describe"]) == (8 << 20, ABOUT)
    table = run_cli("inspect", "--storage-path", str(root)).stdout
    assert "engine vllm" in table and "block size 16" in table
    stats = json.loads(run_cli("stats", "--storage-path", str(root), "--json").stdout)
    assert stats["models"][NS]["describe"] == ABOUT


def test_a_description_that_is_not_json_is_refused(root: Path) -> None:
    with pytest.raises(ConfigError, match="JSON"):
        open_kv_store(root, NS, memory_bytes=0, disk_bytes="4MiB", describe={"x": {1, 2}})
