"""Both LMCache entry points on the ``cluster`` key, through LMCache's own loading (the
storage plugin by its StorageManager, the L2 adapter by its factory): chunks one process
stores are found and loaded bit-exact by a new process, through one ``persisting serve``
member started without ``--model``; with the member SIGKILLed, the plugin's asks are
misses, never exceptions or hangs, and a new L2 adapter -- built when LMCache starts --
says at once that no member answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from persisting.errors import ConfigError
from persisting.integrations.lmcache.settings import l2_params, settings_from_extra_config
from tests.engines.cluster_helpers import cluster_member
from tests.service.service_helpers import REPO, kill_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture
def member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with cluster_member(tmp_path_factory.mktemp("lmcache-cluster")) as started:
        yield started


def run_child(entry: str, mode: str, cluster: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    return subprocess.run(
        [sys.executable, str(REPO / "tests/lmcache/cluster_child.py"), entry, mode,
         json.dumps(cluster)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, start_new_session=True,
    )  # fmt: skip


def child(entry: str, mode: str, cluster: dict[str, Any]) -> dict[str, Any]:
    proc = run_child(entry, mode, cluster)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


@pytest.mark.parametrize("entry", ["plugin", "l2"])
def test_a_chunk_set_on_one_host_is_got_bit_exact_on_another_and_a_lost_member_is_misses(
    entry: str, member: dict[str, Any]
) -> None:
    cluster = member["cluster"]
    stored = child(entry, "set", cluster)
    assert stored in ({"failed": 0}, {"ok": True}), stored
    assert child(entry, "get", cluster) == {"found": 4, "exact": [True] * 4}
    kill_group(member["proc"])
    if entry == "plugin":  # opens the cluster on first use: a member lost is misses
        assert child(entry, "get", cluster) == {"found": 0, "exact": [None] * 4}
    else:  # LMCache builds the adapter at start: with no member answering, a clear error
        proc = run_child(entry, "get", cluster)
        assert proc.returncode != 0
        assert "found 0 'kvstore' server(s) serving" in proc.stderr, proc.stderr[-3000:]


def test_the_cluster_key_replaces_storage_path_in_both_configurations(tmp_path: Path) -> None:
    cluster = {"seeds": ["10.0.0.1:8610"], "passphrase_file": str(tmp_path / "p")}
    params = l2_params({"cluster": cluster, "capacity": "1GiB"})
    assert params.storage_path is None and params.cluster is not None
    assert params.cluster.seeds == ["10.0.0.1:8610"] and params.capacity == 1 << 30
    _settings, options = settings_from_extra_config({"persisting.cluster": json.dumps(cluster)})
    assert options.cluster is not None and options.cluster.name == "kvstore"
    with pytest.raises(ConfigError, match="not both"):
        l2_params({"cluster": cluster, "storage_path": str(tmp_path)})
    with pytest.raises(ConfigError, match="not both"):
        settings_from_extra_config(
            {"persisting.cluster": cluster, "persisting.storage_path": str(tmp_path)}
        )
    with pytest.raises(ConfigError, match="HOST:PORT"):
        l2_params({"cluster": {"seeds": ["nohost"]}})
    with pytest.raises(ConfigError, match="cluster"):
        settings_from_extra_config({"persisting.cluster": {"seeds": []}})
