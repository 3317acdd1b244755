"""PersistingTier behind vLLM's own tiered offloading, on the CPU: no CUDA call.

Each process (``benchmarks/vllm_tiering.py`` in the engine environment) builds vLLM's
``TieringOffloadingSpec`` from an ``OffloadingConfig`` and uses the manager it makes: a
``TieringOffloadingManager`` over a ``CPUPrimaryTierOffloadingManager`` whose rows are a
``SharedOffloadRegion`` in ``/dev/shm``, with ``PersistingTier`` made by vLLM's
``SecondaryTierFactory`` from a ``secondary_tiers`` entry. Chunks are stored into the CPU
tier as vLLM's GPU worker would, cascaded by vLLM to the tier, and promoted back in other
processes. Rows hold two tensor-parallel ranks' slots, each with bytes of its own.

The module fixture runs, on one root:

1. ``a`` and ``c`` at once (two engines sharing the root): once ``c`` has looked chunks
   ``1:*`` up (misses), ``a`` stores chunks ``1:*`` and ``2:*``; ``c`` promotes ``1:*`` once
   ``a`` says they are stored (its rescan found them), then stores ``3:*``, which ``a``
   promotes in turn;
2. ``b``, a new process: promotes ``1:*`` (bytes identical), then, with one payload file
   damaged, every chunk: the damaged one is a failed key, a miss on the lookup after, and
   the only one; the others are promoted with identical bytes;
3. beside ``b``, on roots of their own: ``budget`` streams chunks through a tier with room
   for a few (and a second tier too small for any chunk); ``chain`` stores one request's
   chunks over several steps; ``held`` configures the tier with a metrics port another
   process holds.

The fixture runs once with vLLM 0.32's classes (its CPU build, ``.venv-vllm``) and once with
vLLM 0.34's (the wheel GPU users install, over it: ``.venv-vllm-0.34``), so an interface a
release moves fails here. What 0.34 runs here is its Python: the tiering manager, its CPU
tier's shared rows and the tier factory; its GPU worker (the device copies) runs in neither.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from typing import Any

import pytest

from persisting.integrations.vllm.settings import tiering_config
from tests.engines.engine_helpers import VLLM_VERSIONS, Tiering, stored_parents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

#: One rank's slot of a row (a row holds two: world size 2).
SLOT_KIB = 64
ROW = 2 * SLOT_KIB << 10


def tier(root: Path, **options: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry PersistingConnector makes of these keys on a GPU."""
    extra = {
        "storage_path": str(root),
        "model_version": "test-weights",
        "refresh_interval_s": 0.2,
        **options,
    }
    (entry,) = tiering_config(extra)["secondary_tiers"]
    assert entry["type"] == "PersistingTier"
    return dict(entry)


def plan(tiers: list[dict[str, Any]], steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "row_kib": SLOT_KIB,
        "world_size": 2,
        "chunks": 64,
        "events": True,
        "tiers": tiers,
        "steps": steps,
        **extra,
    }


def steps_of(result: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [s for s in result["steps"] if s["action"] == action]


@pytest.fixture(scope="module", params=VLLM_VERSIONS)
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    version = request.param
    work = tmp_path_factory.mktemp(f"vllm-tier-{version}")
    root = work / "root"
    a_ready, c_up, c_ready = work / "a.ready", work / "c.up", work / "c.ready"
    a = Tiering(
        plan(
            [tier(root)],
            [
                {"action": "wait", "file": str(c_up)},
                {"action": "store", "seed": 1, "count": 12, "jobs": 3},
                {"action": "store", "seed": 2, "count": 6, "jobs": 1},
                {"action": "signal", "file": str(a_ready)},
                {"action": "wait", "file": str(c_ready), "linger": 1.0},
                {"action": "promote", "seed": 3, "count": 6, "jobs": 2},
            ],
        ),
        work,
        "a",
        version,
    )
    c = Tiering(
        plan(
            [tier(root)],
            [
                {"action": "lookup", "seed": 1, "count": 12},
                {"action": "signal", "file": str(c_up)},
                {"action": "wait", "file": str(a_ready), "linger": 1.0},
                {"action": "promote", "seed": 1, "count": 12, "jobs": 2},
                {"action": "store", "seed": 3, "count": 6, "jobs": 1},
                {"action": "signal", "file": str(c_ready)},
            ],
        ),
        work,
        "c",
        version,
    )
    shared = {"a": a.result(), "c": c.result()}
    budget_root, chain_root = work / "budget", work / "chain"
    budget_bytes = 12 * ROW
    b = Tiering(
        plan(
            [tier(root)],
            [
                {"action": "promote", "seed": 1, "count": 12, "jobs": 3},
                {"action": "damage", "dir": str(root), "files": 1},
                {"action": "promote", "seed": 2, "count": 6, "jobs": 1},
                {"action": "promote", "seed": 3, "count": 6, "jobs": 1},
                {"action": "lookup", "seed": 2, "count": 6},
                {"action": "lookup", "seed": 3, "count": 6},
                {"action": "events"},
            ],
        ),
        work,
        "b",
        version,
    )
    budget = Tiering(
        plan(
            [
                tier(budget_root, disk_bytes=budget_bytes),
                tier(work / "tiny", disk_bytes=ROW // 2),  # no chunk fits: every store fails
            ],
            [
                {"action": "store", "seed": 5, "count": 40, "jobs": 8},
                {"action": "events"},
                {"action": "usage", "dir": str(budget_root)},
            ],
            chunks=48,
        ),
        work,
        "budget",
        version,
    )
    chain = Tiering(
        plan(
            [tier(chain_root, eviction="prefix")],
            [{"action": "store", "seed": 6, "count": 24, "jobs": 6, "one_request": True}],
            chunks=32,
        ),
        work,
        "chain",
        version,
    )
    with socket.socket() as taken:  # a metrics port another process holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = Tiering(
            plan(
                [tier(work / "held", metrics_port=taken.getsockname()[1])],
                [{"action": "lookup", "seed": 1, "count": 1}],
            ),
            work,
            "held",
            version,
        ).failure()
    later = {"b": b.result(), "budget": budget.result(), "chain": chain.result(), "held": held}
    return {**shared, **later, "chain_root": chain_root, "budget_bytes": budget_bytes}


def test_a_cascaded_chunk_is_promoted_in_a_new_process_with_identical_bytes(
    runs: dict[str, Any],
) -> None:
    first = steps_of(runs["b"], "promote")[0]
    assert first["hits"] == list(range(12)) and first["identical"]


def test_two_processes_share_one_root(runs: dict[str, Any]) -> None:
    (before,) = steps_of(runs["c"], "lookup")
    assert set(before["results"]) == {"MISS"}  # c started before a stored anything
    (found,) = steps_of(runs["c"], "promote")
    assert found["hits"] == list(range(12)) and found["identical"]
    (back,) = steps_of(runs["a"], "promote")
    assert back["hits"] == list(range(6)) and back["identical"]


def test_a_damaged_file_is_a_failed_key_and_a_miss_afterwards(runs: dict[str, Any]) -> None:
    _first, damaged_seed, other_seed = steps_of(runs["b"], "promote")
    promoted = damaged_seed["hits"] + other_seed["hits"]
    missed = damaged_seed["misses"] + other_seed["misses"]
    assert len(missed) == 1 and len(promoted) == 11  # exactly the damaged chunk
    assert damaged_seed["identical"] and other_seed["identical"]  # never wrong bytes
    after = [r for s in steps_of(runs["b"], "lookup") for r in s["results"]]
    assert after.count("MISS") == 1 and after.count("HIT") == 11


def test_the_budget_holds_and_evictions_are_reported(runs: dict[str, Any]) -> None:
    (events,) = steps_of(runs["budget"], "events")
    (usage,) = steps_of(runs["budget"], "usage")
    assert usage["payload_files"] <= 12
    # Every chunk announced stored in the tier is on disk or announced removed since; a
    # batch over the whole budget keeps its chains' heads, and the rest are not announced.
    stored, removed = events.get("stored_STORAGE", 0), events.get("removed_STORAGE", 0)
    assert 0 < usage["payload_files"] < stored <= 40  # stored, and some of it evicted since
    assert removed >= stored - usage["payload_files"]
    assert usage["bytes"] <= runs["budget_bytes"] * 1.05


def test_a_tier_whose_stores_all_fail_does_not_stop_vllm(runs: dict[str, Any]) -> None:
    (stored,) = steps_of(runs["budget"], "store")
    assert stored["bytes"] == 40 * ROW  # the store step ended: every cascade job finished


def test_each_chunk_is_stored_with_its_requests_previous_chunk_across_steps(
    runs: dict[str, Any],
) -> None:
    """What the prefix-aware eviction order works from: the request's chunks were stored
    in six steps (cascade jobs), and each one's parent is the one before it."""
    chunk = [hashlib.sha256(f"6:{i}".encode()).hexdigest() for i in range(24)]
    parents = stored_parents(runs["chain_root"])
    assert parents == {chunk[i]: chunk[i - 1] if i else None for i in range(24)}


def test_a_metrics_port_another_process_holds_stops_the_engine_at_start(
    runs: dict[str, Any],
) -> None:
    assert "cannot serve metrics on 127.0.0.1:" in runs["held"]


def test_a_store_job_that_fails_never_leaves_its_keys_pending(tmp_path: Path) -> None:
    """A store job with a chunk id outside the CPU tier fails, and the catalog hears of it:
    a later valid store of the same chunk (vLLM's own cascade) writes it."""
    root = tmp_path / "root"
    result = Tiering(
        plan(
            [tier(root)],
            [
                {"action": "raw_store", "tier": 0, "seed": 7, "index": 0, "row": 1 << 20},
                {"action": "store", "seed": 7, "count": 1, "jobs": 1},
                {"action": "usage", "dir": str(root)},
            ],
            chunks=8,
        ),
        tmp_path,
        "stuck",
    ).result()
    (bad,) = steps_of(result, "raw_store")
    assert bad["success"] is False
    (usage,) = steps_of(result, "usage")
    assert usage["payload_files"] == 1
