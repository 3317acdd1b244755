"""PersistingTier with ``cluster`` in place of ``storage_path``, behind vLLM's own tiered
offloading on the CPU (``benchmarks/vllm_tiering.py``, as ``test_vllm_tier.py`` runs it).

One ``persisting serve`` member (started without ``--model``: it serves whatever namespace
an authenticated client opens) with a passphrase; engine ``a`` stores chunks through vLLM's
``TieringOffloadingManager``, engine ``b`` -- a new process -- promotes them with identical
bytes and asks about others; then the member is SIGKILLed and ``b`` goes on: chunks it knew
to be there are failed promotions (misses), new ones misses, stores fail as jobs, and the
process ends cleanly. A local root's engine opens the namespace of the same name. Runs with
vLLM 0.34's classes (what GPU users install); 0.32's run the cluster on hosts of their own
in ``tests/fleet/test_fleet_hosts.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from persisting.integrations.vllm.settings import tiering_config
from tests.engines.cluster_helpers import cluster_member
from tests.engines.engine_helpers import Tiering
from tests.service.service_helpers import kill_group
from tests.timing import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SLOT_KIB = 64


def tier(**where: Any) -> dict[str, Any]:
    extra = {"model_version": "test-weights", "refresh_interval_s": 0.2, **where}
    (entry,) = tiering_config(extra)["secondary_tiers"]
    return dict(entry)


def plan(entry: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"row_kib": SLOT_KIB, "world_size": 2, "chunks": 64, "events": True,
            "tiers": [entry], "steps": steps}  # fmt: skip


@pytest.fixture
def member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with cluster_member(tmp_path_factory.mktemp("tier-cluster")) as started:
        yield started


def _steps(result: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [s for s in result["steps"] if s["action"] == action]


@pytest.mark.parametrize("version", ["0.34"])
def test_chunks_move_between_engines_through_a_cluster_and_a_lost_member_is_misses(
    version: str, member: dict[str, Any], tmp_path: Path
) -> None:
    entry = tier(cluster=member["cluster"])
    a = Tiering(plan(entry, [
        {"action": "store", "seed": 1, "count": 12, "jobs": 3},
        {"action": "store", "seed": 2, "count": 6, "jobs": 1},
    ]), tmp_path, "a", version).result()  # fmt: skip
    row = 2 * SLOT_KIB << 10
    assert [s["bytes"] for s in _steps(a, "store")] == [12 * row, 6 * row]

    up, killed = tmp_path / "b.up", tmp_path / "killed"
    b = Tiering(plan(entry, [
        {"action": "promote", "seed": 1, "count": 12, "jobs": 2},
        {"action": "promote", "seed": 9, "count": 4, "jobs": 1},
        {"action": "lookup", "seed": 2, "count": 6},
        {"action": "settle", "seconds": 1.5},
        {"action": "signal", "file": str(up)},
        {"action": "wait", "file": str(killed), "linger": 0.5},
        {"action": "promote", "seed": 2, "count": 6, "jobs": 1},
        {"action": "promote", "seed": 3, "count": 4, "jobs": 1},
        {"action": "store", "seed": 4, "count": 4, "jobs": 1},
        {"action": "events"},
    ]), tmp_path, "b", version)  # fmt: skip
    try:
        _wait_for(up, b)
    finally:
        kill_group(member["proc"])
        killed.write_text("killed")
    result = b.result()
    promoted, unknown, lost, new = _steps(result, "promote")
    assert promoted["hits"] == list(range(12)) and promoted["identical"]
    assert unknown["hits"] == [] and unknown["misses"] == list(range(4))
    # Known present before the member died: promotions that fail, then misses.
    assert lost["hits"] == [] and lost["misses"] == list(range(6))
    assert new["hits"] == [] and new["misses"] == list(range(4))
    assert result.get("closed")
    log = b.log_file.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]

    # A local root's tier opens the namespace of the same name.
    local = tmp_path / "local"
    Tiering(plan(tier(storage_path=str(local)), [
        {"action": "store", "seed": 5, "count": 1, "jobs": 1},
    ]), tmp_path, "local", version).result()  # fmt: skip
    names = {p.name for p in (local / "kv").iterdir() if p.is_dir()}
    assert names and names <= {p.name for p in (member["root"] / "kv").iterdir()}


def _wait_for(marker: Path, proc: Tiering, timeout_s: float = 300) -> None:
    wait_until(lambda: marker.exists() or proc.proc.poll() is not None, "b ready", timeout_s)
    if not marker.exists():
        raise AssertionError(f"b never got ready:\n{proc._tail()}")
