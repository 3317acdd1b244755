"""Restart recovery in a new process: the plugin remembers, LMCache's LocalDiskBackend forgets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import child_env
from tests.lmcache.lmcache_harness import (
    PLUGIN,
    key,
    make_config,
    payload,
    plugin_of,
    same_bytes,
    storage_manager,
)

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).parent
COUNT = 6


def run_writer(root: Path, disk: Path, durability: str, ending: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [
            sys.executable,
            str(HERE / "restart_writer.py"),
            str(root),
            str(disk),
            str(COUNT),
            durability,
            ending,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_all_chunks_back(root: Path, disk: Path) -> None:
    with storage_manager(make_config(root, local_disk=disk)) as manager:
        keys = [key(i) for i in range(COUNT)]
        # LMCache's own disk backend lost its index with the process...
        assert not manager.storage_backends["LocalDiskBackend"].contains(keys[0])
        # ...the plugin did not.
        hits, mapping = manager.batched_contains(keys)
        assert hits == COUNT and list(mapping) == [PLUGIN]
        got = plugin_of(manager).batched_get_blocking(keys)
        for i, obj in enumerate(got):
            assert obj is not None
            assert same_bytes(obj.tensor, payload(i, obj.tensor.shape, obj.tensor.dtype))
            obj.ref_count_down()


@pytest.mark.slow
def test_chunks_survive_a_clean_restart_in_a_new_process(tmp_path: Path) -> None:
    root, disk = tmp_path / "root", tmp_path / "lmcache-disk"
    result = run_writer(root, disk, "async", "close")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "closed" in result.stdout
    assert any(disk.iterdir())  # LocalDiskBackend did write its files
    assert_all_chunks_back(root, disk)


@pytest.mark.slow
def test_completed_sync_puts_survive_sigkill(tmp_path: Path) -> None:
    root, disk = tmp_path / "root", tmp_path / "lmcache-disk"
    result = run_writer(root, disk, "sync", "kill")
    assert result.returncode == -9, result.stderr[-3000:]
    assert "completed" in result.stdout
    assert_all_chunks_back(root, disk)
