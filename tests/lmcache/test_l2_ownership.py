"""The L2 adapter owns its namespace: a second adapter (or server) on a live one is refused
naming the first; ``stats`` and ``inspect`` of its root show its capacity, usage and
counters; ``adapter_params`` take LMCache's ``max_capacity_gb`` and suggest the closest key
for a typo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from persisting.errors import ConfigError, NamespaceOwnedError
from tests import REPO, child_env
from tests.lmcache.l2_harness import l2_adapter, object_key, store, tensor_obj

HOLDER = """
import sys
from tests.lmcache.l2_harness import l2_adapter
with l2_adapter(sys.argv[1], capacity="64MiB") as adapter:
    print("open", flush=True)
    sys.stdin.readline()
"""

PERSISTING = str(Path(sys.executable).with_name("persisting"))


def test_a_second_adapter_on_a_live_namespace_is_refused_naming_the_first(root: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(NamespaceOwnedError) as refused, l2_adapter(root, capacity="64MiB"):
            pass
        message = str(refused.value)
        assert f"pid {holder.pid} " in message and "LMCache L2 adapter" in message
        assert "capacity 64MiB" in message
        with l2_adapter(root, capacity="64MiB", namespace="other") as other:  # its own
            assert other.get_usage().total_capacity_bytes == 64 << 20
        holder.communicate("\n", timeout=60)
        with l2_adapter(root, capacity="64MiB"):  # the first let go when it closed
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_max_capacity_gb_is_taken_as_lmcaches_adapters_take_it(root: Path) -> None:
    with l2_adapter(root, max_capacity_gb=0.5) as adapter:
        assert adapter.params.capacity == int(0.5 * 1024**3)
        assert adapter.get_usage().total_capacity_bytes == 1 << 29
    with pytest.raises(ConfigError, match=r"capacity .* or max_capacity_gb, not both"):
        l2_adapter(root, capacity="1GiB", max_capacity_gb=1).__enter__()
    with pytest.raises(ConfigError, match="max_capacity_gb must be a number of GiB > 0"):
        l2_adapter(root, max_capacity_gb=0).__enter__()
    with pytest.raises(ConfigError, match=r"unknown adapter_params key 'capcity' \(did you mean"):
        l2_adapter(root, capcity="1GiB").__enter__()
    with pytest.raises(ConfigError, match="did you mean 'max_capacity_gb'"):
        l2_adapter(root, max_capacity_g=1).__enter__()


def test_stats_and_inspect_of_an_adapter_root_show_its_capacity_usage_and_counters(
    root: Path,
) -> None:
    keys = [object_key(i) for i in range(4)]
    with l2_adapter(root, capacity="1GiB") as adapter:
        assert store(adapter, keys, [tensor_obj(i) for i in range(4)]).is_successful()
        used = adapter.get_usage().total_bytes_used
    env = child_env()
    stats = subprocess.run(
        [PERSISTING, "stats", "--json", "--storage-path", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert stats.returncode == 0, stats.stderr
    figures = json.loads(stats.stdout)["models"]["lmcache"]
    assert figures["capacity"]["disk"] == 1 << 30  # the adapter's, not kv.disk_bytes
    assert figures["items"]["disk"] == 4
    owner = figures["owner"]
    assert owner["role"] == "l2-adapter" and not owner["live"]
    status = owner["details"]["status"]
    assert status["state"] == "stopped" and status["stored_object_count"] == 4
    assert status["capacity_bytes"] == 1 << 30 and status["used_bytes"] == used
    assert status["checksum_failures"] == 0 and status["store_failures"] == 0
    text = subprocess.run(
        [PERSISTING, "stats", "--storage-path", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "160"},
        cwd=REPO,
    ).stdout
    assert "LMCache L2 adapter, namespace 'lmcache', capacity 1GiB" in text
    assert "what the disk capacity counts" in text and "stored_object_count" in text
    inventory = subprocess.run(
        [PERSISTING, "inspect", "--json", "--storage-path", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    (model,) = json.loads(inventory.stdout)["models"]
    assert model["chunks"] == 4 and model["owner"]["details"]["capacity"] == 1 << 30
