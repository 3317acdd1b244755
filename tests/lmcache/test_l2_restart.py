"""A new process finds what an earlier one stored through LMCache: every chunk, the usage
per salt, the original ObjectKeys, and the eviction order (LMCache's own LRU policy gets it
back). LMCache's own disk adapters forget usage and order on restart."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from persisting.integrations.lmcache import PersistingL2Adapter
from tests import child_env
from tests.kv.kv_helpers import in_flight
from tests.lmcache.l2_harness import (
    adapter_json,
    adapter_of,
    bytes_of,
    du_bytes,
    eviction_order,
    l2_adapter,
    load,
    object_key,
    payload,
    prefetch,
    storage_manager,
    tensor_obj,
)
from tests.lmcache.l2_writer import BIG, BIG_SHAPE, KEYS
from tests.timing import wait_until

pytestmark = pytest.mark.timeout(240)
HERE = Path(__file__).parent
CHUNK_BYTES = 2 * 4 * 16 * 256 * 2


def run_writer(root: Path, mode: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [sys.executable, str(HERE / "l2_writer.py"), str(root), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def assert_every_chunk_loads(manager, keys=KEYS) -> None:  # type: ignore[no-untyped-def]
    result = prefetch(manager, keys)
    assert result.l2_hit_count == len(keys)
    with manager.read_prefetched_results(keys) as objs:
        assert objs is not None
        for i, obj in enumerate(objs):
            assert torch.equal(bytes_of(obj), payload(i, CHUNK_BYTES)), i
    manager.finish_read_prefetched(keys)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A root written (and closed) by another process, with what that process reported."""
    root = tmp_path_factory.mktemp("l2") / "root"
    result = run_writer(root, "close")
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads(result.stdout.strip().splitlines()[-1])


def copy_of(root: Path, tmp_path: Path) -> Path:
    """A copy of the written root (each test opens its own: opening may change it)."""
    target = tmp_path / "root"
    shutil.copytree(root, target)
    return target


@pytest.mark.slow
def test_chunks_usage_and_keys_come_back(written: tuple[Path, dict], tmp_path: Path) -> None:
    root, report = written
    with storage_manager(adapter_json(copy_of(root, tmp_path), capacity="64MiB")) as manager:
        adapter = adapter_of(manager)
        usage = adapter.get_usage()
        assert dict(usage.bytes_by_cache_salt) == report["by_salt"]
        # The total covers the metadata too, which opening may compact: what du says now.
        assert usage.total_bytes_used >= sum(report["by_salt"].values())
        assert usage.total_bytes_used == du_bytes(adapter.store.directory)
        listed = {e.key.to_object_key() for e in adapter.list_l2_keys(page_size=100).entries}
        assert listed == set(KEYS)  # salts, ranks and groups as they were stored
        assert_every_chunk_loads(manager)


@pytest.mark.slow
def test_lmcache_s_eviction_policy_gets_the_order_back(
    written: tuple[Path, dict], tmp_path: Path
) -> None:
    root, report = written
    never = {"eviction": {"eviction_policy": "LRU", "trigger_watermark": 1.0}}
    entry = adapter_json(copy_of(root, tmp_path), capacity="64MiB", entry=never)
    with storage_manager(entry) as manager:
        assert eviction_order(manager) == report["order"]
    # The chunks read last before the restart are the last to go.
    read_last = {repr(KEYS[i]) for i in (0, 1, 2)}
    assert set(report["order"][-3:]) == read_last


@pytest.mark.slow
def test_lmcache_evicts_in_the_order_kept_across_the_restart(
    written: tuple[Path, dict], tmp_path: Path
) -> None:
    root, report = written
    soon = {
        "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.001, "eviction_ratio": 0.3}
    }
    entry = adapter_json(copy_of(root, tmp_path), capacity="64MiB", entry=soon)
    with storage_manager(entry) as manager:
        adapter = adapter_of(manager)
        first = {k for k in KEYS if repr(k) in report["order"][:3]}
        wait_until(lambda: not any(adapter.debug_has_key(k) for k in first), "eviction")
        survivors = [k for k in KEYS if repr(k) in report["order"][3:]]
        assert any(adapter.debug_has_key(k) for k in survivors)
        # What LMCache evicted, it evicted least recently used first.
        gone = [k for k in KEYS if not adapter.debug_has_key(k)]
        ranks = sorted(report["order"].index(repr(k)) for k in gone)
        assert ranks == list(range(len(gone)))


@pytest.mark.slow
def test_completed_stores_survive_sigkill(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = run_writer(root, "kill")
    assert result.returncode == -9, result.stderr[-3000:]
    assert "stored" in result.stdout
    with storage_manager(adapter_json(root, capacity="256MiB")) as manager:
        assert_every_chunk_loads(manager)


@pytest.mark.slow
def test_a_store_torn_by_sigkill_is_never_visible(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = run_writer(root, "torn")
    assert result.returncode == -9, result.stderr[-3000:]
    with l2_adapter(root, capacity="256MiB") as adapter:
        assert isinstance(adapter, PersistingL2Adapter)
        assert in_flight(root / "kv" / "lmcache") == []  # no half-written file
        dest = [tensor_obj(None) for _ in KEYS]
        assert load(adapter, KEYS, dest) == list(range(len(KEYS)))
        big = [object_key(1000 + i) for i in range(BIG)]
        present = [k for k in big if adapter.debug_has_key(k)]
        assert len(present) < BIG  # the kill landed mid-task
        # Whatever of the torn task is visible is whole: every byte as it was written.
        dest = [tensor_obj(None, BIG_SHAPE) for _ in present]
        assert load(adapter, present, dest) == list(range(len(present)))
        for key, obj in zip(present, dest, strict=True):
            seed = 1000 + big.index(key)
            assert torch.equal(bytes_of(obj), payload(seed, obj.get_size()))
        assert adapter.report_status()["checksum_failures"] == 0
