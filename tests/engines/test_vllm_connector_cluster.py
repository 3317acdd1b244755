"""PersistingConnector with ``cluster`` in place of ``storage_path``, under a real vLLM
engine (CPU build), each engine its own process.

One ``persisting serve`` member (started without ``--model``, with a passphrase); then:

1. ``first`` stores a 1,500-token prompt (11 blocks of 128 tokens) in the cluster and waits
   for the member's payload files;
2. the member is SIGKILLed; ``third``, a new process, starts all the same (the cluster does
   not answer: every block is a miss) and runs the prompt to the same ids, recomputed;
3. ``local``: the prompt on a local root opens the namespace of the same name as the
   cluster's (two engine hosts with one model share it).

A new engine process reusing the prompt through a cluster -- and through its loss of a
member -- is ``tests/fleet/test_fleet_hosts.py``, on hosts of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines.cluster_helpers import cluster_member
from tests.engines.engine_helpers import BLOCK, build_model, free_port, run_engine, scraped, step
from tests.service.service_helpers import kill_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = [1500, 1]
BLOCKS = 1500 // BLOCK


def _engine(model: Path, extra: dict[str, Any], port: int, steps: list[Any]) -> dict[str, Any]:
    """A plan that ends by scraping the scheduler's metrics (its lookups), then the
    worker's (its loads and stores: another process)."""
    scrapes = [{"action": "scrape", "url": f"http://127.0.0.1:{port + i}/metrics"} for i in (0, 1)]
    return {
        "model": str(model),
        "max_model_len": 2048,
        "connector": {"kind": "persisting", "extra": {**extra, "metrics_port": port}},
        "steps": [*steps, *scrapes],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = build_model(tmp_path_factory.mktemp("model") / "llama", layers=2, hidden=256)
    work = tmp_path_factory.mktemp("vllm-connector-cluster")
    prompt = {"name": "prompt", "prompt": PROMPT, "max_tokens": 8}
    with cluster_member(tmp_path_factory.mktemp("member")) as member:
        extra = {"cluster": member["cluster"], "refresh_interval_s": 0.5}
        stored = {"action": "wait_files", "dir": str(member["root"] / "kv"), "count": BLOCKS}
        out: dict[str, Any] = {"member": member["root"]}
        first = _engine(model, extra, free_port(), [prompt, stored])
        out["first"] = run_engine(first, work, "first")
        kill_group(member["proc"])
    out["third"] = run_engine(_engine(model, extra, free_port(), [prompt]), work, "third")
    out["third log"] = (work / "third.log").read_text(errors="replace")
    local = {"storage_path": str(work / "local")}
    wait = {"action": "wait_files", "dir": str(work / "local" / "kv"), "count": BLOCKS}
    out["local"] = run_engine(_engine(model, local, free_port(), [prompt, wait]), work, "local")
    out["local root"] = work / "local"
    return out


def test_an_engine_stores_its_prompt_in_the_cluster(runs: dict[str, Any]) -> None:
    assert step(runs["first"], "prompt")["cached"] == 0
    stored = scraped(runs["first"], 1)
    assert stored["persisting_vllm_blocks_stored_total"] == BLOCKS
    assert stored["persisting_vllm_store_errors_total"] == 0


def test_a_lost_member_is_a_recompute_never_an_error(runs: dict[str, Any]) -> None:
    third = step(runs["third"], "prompt")
    assert third["cached"] == 0
    assert third["ids"] == step(runs["first"], "prompt")["ids"]
    assert "Traceback" not in runs["third log"], runs["third log"][-4000:]
    assert scraped(runs["third"], 0)["persisting_vllm_lookup_hits_total"] == 0
    assert scraped(runs["third"], 1)["persisting_vllm_blocks_loaded_total"] == 0


def test_the_cluster_namespace_is_the_one_a_local_root_opens(runs: dict[str, Any]) -> None:
    local, member = (
        {p.name for p in (root / "kv").iterdir() if p.is_dir() and p.name.startswith("vllm.")}
        for root in (runs["local root"], runs["member"])
    )
    assert len(local) == 1 and local <= member, (local, member)
    assert step(runs["local"], "prompt")["ids"] == step(runs["first"], "prompt")["ids"]
