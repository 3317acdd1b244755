"""A hybrid model under PersistingConnector on vLLM's CPU backend, measured.

A random-weight ``Gemma3ForCausalLM`` whose two layers alternate a 256-token sliding window
and full attention: vLLM gives it two KV-cache groups. vLLM cannot map block ids of failed
loads back to requests across several groups (``Scheduler._handle_invalid_blocks`` raises),
so the connector reports such a failure by request (``failed_recving``) and vLLM
recomputes that request from its start. Two engine processes on one root:

1. ``first`` stores a 1,500-token prompt (both groups' blocks) and exits;
2. ``second`` restores it, then with every block file damaged runs it again (the load
   fails, the request is recomputed), again (the failed blocks are not offered: computed
   and stored afresh), then once more (restored from the fresh blocks).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engines.engine_helpers import build_model, free_port, run_engine, scraped, step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = [1500, 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-hybrid")
    model = build_model(work / "gemma3", layers=2, hidden=256, arch="gemma3")
    root = work / "root"
    port = free_port()
    connector = {
        "kind": "persisting",
        "extra": {"storage_path": str(root), "metrics_port": port, "refresh_interval_s": 0.5},
    }
    plan = {"model": str(model), "max_model_len": 2048, "connector": connector}
    prompt = {"name": "prompt", "prompt": PROMPT, "max_tokens": 8}
    first = run_engine({**plan, "steps": [prompt]}, work, "first")
    files = sum(1 for p in root.rglob("*.kv"))
    worker = f"http://127.0.0.1:{port + 1}/metrics"
    second = run_engine(
        {
            **plan,
            "steps": [
                prompt,
                {"action": "scrape", "url": worker},
                {"action": "damage", "dir": str(root / "kv")},
                {**prompt, "name": "damaged"},
                {"action": "scrape", "url": worker},
                # vLLM does not store what it recomputed after a failed load: this does
                {**prompt, "name": "after damage"},
                {"action": "wait_files", "dir": str(root / "kv"), "count": files},
                {"action": "settle", "seconds": 2.0},
                {**prompt, "name": "again"},
            ],
        },
        work,
        "second",
    )
    return {"first": first, "second": second, "files": files}


def test_a_hybrid_models_prompt_is_restored_in_a_new_process(runs: dict[str, Any]) -> None:
    stored, restored = step(runs["first"], "prompt"), step(runs["second"], "prompt")
    assert runs["files"] > 1500 // 128  # both groups' blocks were stored
    assert stored["cached"] == 0
    assert restored["cached"] >= 1024 and restored["ids"] == stored["ids"]


def test_a_failed_load_recomputes_the_request_then_its_blocks_are_stored_afresh(
    runs: dict[str, Any],
) -> None:
    ids = step(runs["first"], "prompt")["ids"]
    damaged = step(runs["second"], "damaged")
    assert damaged["ids"] == ids  # recomputed, never the damaged bytes
    before, after = scraped(runs["second"], 0), scraped(runs["second"], 1)
    assert after["persisting_vllm_load_errors_total"] > before["persisting_vllm_load_errors_total"]
    after = step(runs["second"], "after damage")
    assert after["cached"] == 0 and after["ids"] == ids  # the failed blocks: not offered
    again = step(runs["second"], "again")
    assert again["cached"] >= 1024 and again["ids"] == ids
