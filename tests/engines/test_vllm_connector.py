"""PersistingConnector under a real vLLM engine (CPU build), each engine its own process.

One module fixture runs the engines once, in order, on one storage root; the tests read
what they did:

1. ``first``: stores a 1,500-token prompt (11 blocks of 128 tokens, prefilled in three
   steps of at most 512 tokens), waits for the blocks' files, and is SIGKILLed with its
   engine processes (no shutdown, no flush);
2. ``second``: a new process; the prompt again (restored), an unseen prompt, then every
   payload file damaged and the prompt once more (loads fail, vLLM recomputes), then every
   block file made unreadable (an I/O error) and the prompt again (recomputed, the blocks
   stored afresh), and once more (restored from the fresh blocks);
3. ``float16``: a new process with another dtype (another KV layout: another namespace),
   whose disk budget (``eviction = "prefix"``) holds 7 of the prompt's 11 blocks; then
   ``float16 again``, a new process on that namespace, the prompt once more;
4. ``reweighted``: the model's directory rebuilt with other random weights (same config,
   same path), then the prompt in a new process on the same root.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engines.engine_helpers import (
    BLOCK,
    build_model,
    free_port,
    persisting_cli,
    run_engine,
    scraped,
    step,
    stored_parents,
)

#: Engines start in 12-25 s alone, minutes on a loaded machine: the fixtures run several.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPT = [1500, 1]
UNSEEN = [1500, 2]
BLOCKS = 1500 // BLOCK
#: One stored block: 2 layers x K and V x 128 tokens x hidden 256 x 2 bytes (bf16).
BLOCK_BYTES = 2 * 2 * BLOCK * 256 * 2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "llama", layers=2, hidden=256)


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-connector")
    root = work / "root"
    port = free_port()
    extra = {
        "storage_path": str(root),
        "disk_bytes": "1GiB",
        "metrics_port": port,
        "refresh_interval_s": 0.5,
    }
    plan = {"model": str(model), "max_model_len": 2048}
    connector = {"kind": "persisting", "extra": extra}
    first = run_engine(
        {
            **plan,
            "max_num_batched_tokens": 512,
            "connector": connector,
            "steps": [
                {"name": "prompt", "prompt": PROMPT, "max_tokens": 8},
                {"action": "wait_files", "dir": str(root / "kv"), "count": BLOCKS},
                {"action": "kill"},
            ],
        },
        work,
        "first",
        killed=True,
    )
    parents = stored_parents(root)
    stats = json.loads(persisting_cli("stats", "--storage-path", str(root), "--json"))
    inspect = json.loads(persisting_cli("inspect", "--storage-path", str(root), "--json"))
    worker_metrics = f"http://127.0.0.1:{port + 1}/metrics"
    second = run_engine(
        {
            **plan,
            "connector": connector,
            "steps": [
                {"name": "prompt", "prompt": PROMPT, "max_tokens": 8},
                {"name": "unseen", "prompt": UNSEEN, "max_tokens": 8},
                {"action": "scrape", "url": worker_metrics},
                {"action": "damage", "dir": str(root / "kv")},
                {"name": "damaged", "prompt": PROMPT, "max_tokens": 8},
                {"action": "scrape", "url": worker_metrics},
                # vLLM does not store blocks it recomputed after a failed load: the next
                # request computing them does
                {"name": "after damage", "prompt": PROMPT, "max_tokens": 8},
                {"action": "wait_files", "dir": str(root / "kv"), "count": 2 * BLOCKS},
                # the scheduler's rescan (every 0.5 s) has seen the fresh files, so it
                # offers them; their reads then fail with an I/O error
                {"action": "settle", "seconds": 2.0},
                {"action": "unreadable", "dir": str(root / "kv")},
                {"name": "unreadable", "prompt": PROMPT, "max_tokens": 8},
                {"action": "scrape", "url": worker_metrics},
                {"name": "not offered", "prompt": PROMPT, "max_tokens": 8},
                {"action": "scrape", "url": worker_metrics},
                # the prompt's blocks written afresh (the unseen prompt's are still links)
                {"action": "wait_files", "dir": str(root / "kv"), "count": BLOCKS},
                {"action": "settle", "seconds": 2.0},
                {"name": "stored afresh", "prompt": PROMPT, "max_tokens": 8},
            ],
        },
        work,
        "second",
    )
    small = {"kind": "persisting", "extra": {**extra, "disk_bytes": "2MiB", "eviction": "prefix"}}
    float16 = run_engine(
        {
            **plan,
            "dtype": "float16",
            "connector": small,  # a 2 MiB root, half of it the bfloat16 namespace's floor
            "steps": [
                {"name": "prompt", "prompt": PROMPT, "max_tokens": 8},
                {"action": "settle", "seconds": 5},
                {"action": "scrape", "url": worker_metrics},
            ],
        },
        work,
        "float16",
    )
    float16_again = run_engine(
        {
            **plan,
            "dtype": "float16",
            "connector": small,
            "steps": [{"name": "prompt", "prompt": PROMPT, "max_tokens": 8}],
        },
        work,
        "float16-again",
    )
    build_model(model, layers=2, hidden=256, seed=1)  # other weights, same config and path
    reweighted = run_engine(
        {**plan, "connector": connector, "steps": [{"name": "prompt", "prompt": PROMPT}]},
        work,
        "reweighted",
    )
    return {
        "first": first,
        "second": second,
        "float16": float16,
        "float16 again": float16_again,
        "reweighted": reweighted,
        "parents": parents,
        "stats": stats,
        "inspect": inspect,
        "root": root,
    }


def test_a_new_engine_process_reuses_the_stored_prompt(runs: dict[str, Any]) -> None:
    stored = step(runs["first"], "prompt")
    restored = step(runs["second"], "prompt")
    assert stored["cached"] == 0
    assert restored["cached"] >= 1024
    assert restored["ids"] == stored["ids"]


def test_an_unseen_prompt_reuses_nothing(runs: dict[str, Any]) -> None:
    assert step(runs["second"], "unseen")["cached"] == 0


def test_damaged_blocks_are_recomputed_never_used(runs: dict[str, Any]) -> None:
    assert step(runs["second"], "damaged")["ids"] == step(runs["first"], "prompt")["ids"]
    before, after = scraped(runs["second"], 0), scraped(runs["second"], 1)
    assert before["persisting_vllm_load_errors_total"] == 0
    assert after["persisting_vllm_load_errors_total"] >= 1


def test_an_unreadable_block_fails_once_and_is_offered_again_once_stored_afresh(
    runs: dict[str, Any],
) -> None:
    """A block whose file cannot be read (an I/O error) fails once: the retried request
    completes with the same ids; the block is not offered again (no further load errors)
    until a request stores it afresh, and is offered once it is."""
    ids = step(runs["first"], "prompt")["ids"]
    after_damage = step(runs["second"], "after damage")
    assert after_damage["cached"] == 0 and after_damage["ids"] == ids  # damaged: not offered
    assert step(runs["second"], "unreadable")["ids"] == ids
    errors = [scraped(runs["second"], i)["persisting_vllm_load_errors_total"] for i in (1, 2, 3)]
    assert 1 <= errors[1] - errors[0] <= BLOCKS  # each offered block failed once: no loop
    not_offered = step(runs["second"], "not offered")
    assert not_offered["cached"] == 0 and not_offered["ids"] == ids
    assert errors[2] == errors[1]  # nothing offered, so nothing failed again
    afresh = step(runs["second"], "stored afresh")
    assert afresh["cached"] >= 1024 and afresh["ids"] == ids


def test_another_dtype_is_another_namespace_and_a_miss(runs: dict[str, Any]) -> None:
    assert step(runs["float16"], "prompt")["cached"] == 0
    namespaces = [p.name for p in (runs["root"] / "kv").iterdir() if p.is_dir()]
    assert len(namespaces) >= 2, namespaces


def test_new_weights_under_the_same_path_are_a_miss_never_old_kv(runs: dict[str, Any]) -> None:
    reweighted = step(runs["reweighted"], "prompt")
    assert reweighted["cached"] == 0  # computed by the new weights, nothing reused
    assert reweighted["ids"] != step(runs["first"], "prompt")["ids"][: len(reweighted["ids"])]


def test_each_block_is_stored_with_the_block_before_it_across_steps(
    runs: dict[str, Any],
) -> None:
    """The prompt was prefilled (and stored) in three steps: one chain, one root."""
    parents = runs["parents"]
    assert len(parents) == BLOCKS
    assert [p for p in parents.values() if p is None] == [None]
    assert set(parents.values()) - {None} <= set(parents)
    assert len(set(parents.values())) == BLOCKS  # nobody's parent twice: a single chain


def test_a_prompt_longer_than_the_disk_budget_keeps_its_first_blocks(
    runs: dict[str, Any],
) -> None:
    """The root's 2 MiB are shared with the bfloat16 namespace, idle but within its grace
    period, so each keeps its floor (half): the store keeps the prompt's head (a prefix
    still hits; its tail alone never would), and a new process reuses it."""
    figures = scraped(runs["float16"], 0)
    stored = figures["persisting_vllm_blocks_stored_total"]
    assert 1 <= stored < BLOCKS
    assert figures["persisting_vllm_disk_bytes"] <= figures["persisting_vllm_disk_capacity"]
    again = step(runs["float16 again"], "prompt")
    assert again["cached"] >= BLOCK * (stored - 1)
    assert again["ids"] == step(runs["float16"], "prompt")["ids"]


def test_metrics_count_the_restore(runs: dict[str, Any]) -> None:
    figures = scraped(runs["second"], 0)
    assert figures["persisting_vllm_blocks_loaded_total"] >= 1024 // BLOCK
    assert figures["persisting_vllm_bytes_loaded_total"] == (
        figures["persisting_vllm_blocks_loaded_total"] * BLOCK_BYTES
    )
    assert figures["persisting_vllm_disk_items"] >= BLOCKS


def test_stats_and_inspect_show_what_the_engine_stored(runs: dict[str, Any]) -> None:
    ((name, figures),) = runs["stats"]["models"].items()
    assert name.startswith("vllm.llama.")
    assert figures["items"]["disk"] == BLOCKS
    (listed,) = runs["inspect"]["models"]
    assert listed["model"] == name and listed["chunks"] == BLOCKS
    assert listed["bytes"] >= BLOCKS * BLOCK_BYTES
    described = listed["describe"]
    assert described["engine"] == "vllm" and described["dtype"] == "bfloat16"
    assert described["block_size"] == [BLOCK] and described["weights"].startswith("files:")
