"""PersistingConnector's CPU worker under vLLM's own worker-side classes, against vLLM 0.32
(its CPU build, ``.venv-vllm``) and vLLM 0.34 (the wheel GPU users install, over it:
``.venv-vllm-0.34``), so that the next release that moves the offloading worker's interface
fails here rather than in a user's engine.

Each version's process (``tests/engines/vllm_worker_kit.py``, both started at once) builds a
real ``VllmConfig`` and ``KVCacheConfig``, PersistingConnector in the worker role with real
CPU KV-cache tensors, and drives it as vLLM's model runner does, step by step
(``OffloadingConnectorMetadata`` bound, ``start_load_kv``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``): vLLM's ``OffloadingConnectorWorker`` submits the jobs --
0.32 with block ids, 0.34 with the ``DevicePointers`` it resolves from them. In order:
three blocks stored, loaded into other blocks, loaded as a sync (expedited) load (0.34;
0.32 has none), loaded with one payload file damaged, a store and a load whose keys are not
blocks' keys (an exception inside the job), and a load after them.

What does not run against 0.34 here: an engine. vLLM publishes no CPU build after 0.32, and
0.34's CUDA wheel refuses its CPU platform on x86 without triton-cpu (so 0.34's config is
built with the platform unspecified and the device ``cpu``); its compiled ops and device
copies are not used. The engine tests (``test_vllm_connector.py``, ``test_vllm_hybrid.py``,
``test_vllm_serve.py``) run on 0.32.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.engines.engine_helpers import VLLM_VERSIONS, build_model, engine_env, require_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KIT = Path(__file__).with_name("vllm_worker_kit.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    model = build_model(tmp_path_factory.mktemp("model") / "tinymodel", layers=2, hidden=256)
    work = tmp_path_factory.mktemp("vllm-worker")
    procs = {}
    for version in VLLM_VERSIONS:
        python = require_engine(version)
        out, log = work / f"{version}.json", work / f"{version}.log"
        with open(log, "wb") as sink:
            procs[version] = subprocess.Popen(
                [str(python), str(KIT), str(model), str(work / f"root-{version}"), str(out)],
                env={**engine_env(), "XDG_CACHE_HOME": str(work / "cache")},
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    results = {}
    for version, proc in procs.items():
        log = work / f"{version}.log"
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = -9
        if code != 0:
            tail = log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"the worker kit on vLLM {version} exited {code}:\n{tail}")
        results[version] = json.loads((work / f"{version}.json").read_text())
    return results


@pytest.fixture(params=VLLM_VERSIONS)
def run(request: pytest.FixtureRequest, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    result = runs[request.param]
    assert result["vllm"].startswith(request.param + ".")
    assert result["worker"] == "PersistingWorker"
    return result


def test_stored_blocks_load_back_into_other_blocks_with_identical_bytes(
    run: dict[str, Any],
) -> None:
    store, load = run["store"], run["load"]
    assert store["completed"] == [store["job"]] and store["failed_jobs"] == []
    assert load["req"] in load["recving"] and load["identical"] == [True, True, True]
    assert load["error_blocks"] == [] and load["failed_keys"] == []


def test_a_sync_load_is_in_place_within_its_step(run: dict[str, Any]) -> None:
    """vLLM 0.33 and 0.34 wait for a sync load within the step (``expedited=True``)."""
    if run["vllm"].startswith("0.32."):
        assert "sync_load" not in run  # 0.32 has no sync loads
        return
    sync = run["sync_load"]
    assert sync["filled_in_step"] == [True, True, True] and sync["identical"] == [True] * 3
    assert sync["completed"] == [sync["job"]] and sync["failed_jobs"] == []
    assert sync["recving"] == []  # its request already ran: vLLM reports no recving


def test_a_damaged_block_is_reported_by_block_id_and_never_used(run: dict[str, Any]) -> None:
    damaged = run["damaged"]
    assert len(damaged["error_blocks"]) == 1 and damaged["error_blocks"][0] in (11, 12, 13)
    assert len(damaged["failed_keys"]) == 1
    assert damaged["req"] in damaged["recving"] and damaged["failed_jobs"] == []


def test_a_job_that_raises_finishes_and_the_worker_goes_on(run: dict[str, Any]) -> None:
    """Keys that are not blocks' keys raise inside the job (before this, the exception left
    ``get_finished`` and took the worker process down). The store finishes as failed where
    vLLM takes a failed job (0.34: its blocks are not published), the load's block is
    reported for vLLM to recompute, and the next load works."""
    bad_store, bad_load, after = run["bad_store"], run["bad_load"], run["after"]
    assert bad_store["completed"] == [bad_store["job"]]
    assert bad_store["failed_jobs"] == ([bad_store["job"]] if run["job_failures"] else [])
    assert bad_load["error_blocks"] == [14] and bad_load["failed_keys"] == ["garbage"]
    assert bad_load["req"] in bad_load["recving"]
    assert after["identical"] == [True, True] and after["error_blocks"] == []


def test_the_worker_metadata_carries_vllms_failed_jobs(run: dict[str, Any]) -> None:
    merged = run["aggregate"]
    assert merged["type"] == "PersistingWorkerMetadata" and merged["failed_keys"] == ["k"]
    assert merged["completed"] == [7, 8]
    assert merged["failed_jobs"] == ([7, 8] if run["job_failures"] else [])
    assert run["job_failures"] == (not run["vllm"].startswith("0.32."))


def test_lookahead_block_hashes_open_another_namespace(runs: dict[str, dict[str, Any]]) -> None:
    """vLLM 0.34's lookahead block hashes (a VllmConfig field 0.32 lacks) are in the
    namespace digest when on, and in its description; off, the namespace is unchanged."""
    assert "lookahead" not in runs["0.32"]
    assert runs["0.34"]["lookahead"] == {
        "same_namespace_when_off": True,
        "other_namespace_when_on": True,
        "described": 1,
    }
