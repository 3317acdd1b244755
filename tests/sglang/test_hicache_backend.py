"""Persisting as SGLang's HiCache L3 backend, driven by SGLang's own code on the CPU.

Each run is a process of ``benchmarks/sglang_kit.py`` in ``.venv-sglang``: SGLang's device
and host KV pools, its ``HiCacheStorageConfig``, and its ``StorageBackendFactory`` building
the backend from the documented extra config (``--hicache-storage-backend dynamic``), then
registered with the pool as SGLang's cache controller registers it. No SGLang engine runs
(none runs on a CPU-only host); the pages move between SGLang's host pool and the disk
exactly as its prefetch and backup threads move them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.sglang_helpers import du, extra_config, page_keys, run_kit

pytestmark = pytest.mark.slow

POOLS = {
    "mha-page_first": {"kind": "mha", "layout": "page_first"},
    "mha-layer_first": {"kind": "mha", "layout": "layer_first"},
    "mla-page_first": {"kind": "mla", "layout": "page_first"},
    "mla-layer_first": {"kind": "mla", "layout": "layer_first"},
}


def _plan(root: Path, pool: dict, steps: list[dict], **backend) -> dict:
    extra = backend.pop("extra", None) or extra_config(root)
    return {"pool": pool, "backend": {"name": "dynamic", "extra": extra, **backend}, "steps": steps}


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_pages_survive_sigkill_and_come_back_bit_exact_in_a_new_process(tmp_path, pool) -> None:
    root, keys, slots = tmp_path / "root", page_keys(6), list(range(6))
    wrote = run_kit(
        _plan(
            root,
            pool,
            [
                {"do": "fill", "slots": slots, "seed": 1},
                {"do": "digest", "slots": slots},
                {"do": "set", "keys": keys, "slots": slots},
                {"do": "kill"},  # nothing closed, flushed or committed
            ],
        ),
        tmp_path,
        "writer",
        killed=True,
    )["steps"]
    digests, stored = wrote[1], wrote[2]
    assert stored == [True] * 6
    assert len(set(digests)) == 6
    # A new process, other host slots; for MLA another TP rank (the KV is replicated: rank
    # 0 wrote it for all).
    other = [10 + s for s in slots]
    rank = {"tp_rank": 1, "tp_size": 2} if pool["kind"] == "mla" else {}
    read = run_kit(
        _plan(
            root,
            pool,
            [
                {"do": "digest", "slots": other},
                {"do": "exists", "keys": keys},
                {"do": "get", "keys": keys, "slots": other},
                {"do": "digest", "slots": other},
            ],
            **rank,
        ),
        tmp_path,
        "reader",
    )["steps"]
    assert read[0] != digests  # the slots did not hold the pages before
    assert read[1] == 6
    assert read[2] == [True] * 6
    assert read[3] == digests


def test_a_missing_page_ends_the_run_and_a_damaged_one_is_false(tmp_path) -> None:
    root, keys, slots = tmp_path / "root", page_keys(8), list(range(8))
    present = [k for i, k in enumerate(keys) if i != 4]
    steps = run_kit(
        _plan(
            root,
            POOLS["mha-page_first"],
            [
                {"do": "fill", "slots": slots, "seed": 2},
                {"do": "set", "keys": present, "slots": [s for s in slots if s != 4]},
                {"do": "exists", "keys": keys},  # 2: stops at the first missing page
                {"do": "damage", "key": keys[2]},
                {"do": "digest", "slots": [1, 3]},
                {"do": "zero"},
                {"do": "get", "keys": keys[:4], "slots": [0, 1, 2, 3]},  # 3
                {"do": "digest", "slots": [1, 3]},
                {"do": "exists", "keys": keys},  # 6: the damaged page is a miss now
                {"do": "get", "keys": [keys[4]], "slots": [4]},  # 7: never stored
                {"do": "disk", "root": str(root)},  # 8
                {"do": "set_flat", "keys": keys[2:3], "slots": [2]},  # 9: generic path
                {"do": "exists", "keys": keys[:4]},
                {"do": "clear"},  # 11
                {"do": "exists", "keys": keys},
            ],
        ),
        tmp_path,
        "damage",
    )["steps"]
    assert not any(isinstance(s, dict) and "error" in s for s in steps), steps
    assert steps[2] == 4
    assert steps[6] == [True, True, False, True]  # no exception, the page is False
    assert steps[7] == steps[4]  # the good pages around it are whole
    assert steps[8] == 2
    assert steps[9] == [False]
    figures = steps[10]["stats"]
    assert figures["pages_damaged"] == 1 and figures["get_misses"] == 1
    assert figures["pages_set"] == 7 and figures["errors"] == 0
    assert figures["store"]["disk_items"] == 6
    # A page set through the generic pair is not a page of the v1 pair (its bytes are laid
    # out another way): the damaged page stays a miss for the v1 pair.
    assert steps[11] is True and steps[12] == 2
    assert steps[13] is True and steps[14] == 0


def test_the_v1_and_generic_pairs_never_read_each_others_pages(tmp_path) -> None:
    """The two pairs lay a page out differently (the layer-first pool's parts end to end,
    or SGLang's flat data page): a page set through one is a miss through the other, never
    a hit with other bytes; each pair still reads back its own pages."""
    root, keys = tmp_path / "root", page_keys(4)
    steps = run_kit(
        _plan(
            root,
            POOLS["mha-layer_first"],
            [
                {"do": "fill", "slots": [0, 1, 2, 3], "seed": 3},
                {"do": "digest", "slots": [0, 1, 2, 3]},  # 1
                {"do": "set", "keys": keys[:2], "slots": [0, 1]},  # v1
                {"do": "set_flat", "keys": keys[2:], "slots": [2, 3]},  # generic
                {"do": "zero"},
                {"do": "get_flat", "keys": keys[:2], "slots": [4, 5]},  # 5
                {"do": "get", "keys": keys[2:], "slots": [6, 7]},  # 6
                {"do": "exists", "keys": keys[2:]},  # 7: the v1 pair's pages only
                {"do": "get", "keys": keys[:2], "slots": [0, 1]},  # 8
                {"do": "get_flat", "keys": keys[2:], "slots": [2, 3]},  # 9
                {"do": "digest", "slots": [0, 1, 2, 3]},  # 10
            ],
        ),
        tmp_path,
        "pairs",
    )["steps"]
    assert not any(isinstance(s, dict) and "error" in s for s in steps), steps
    assert steps[2] == [True, True] and steps[3] is True
    assert steps[5] == [False, False] and steps[6] == [False, False]
    assert steps[7] == 0
    assert steps[8] == [True, True] and steps[9] == [True, True]
    assert steps[10] == steps[1]


def test_the_disk_budget_holds_with_pages_evicted(tmp_path) -> None:
    root = tmp_path / "root"
    budget = 4 << 20
    pool = {"kind": "mha", "layout": "page_first", "layers": 8, "heads": 4, "head_dim": 128}
    keys = page_keys(64)  # 64 pages of 256 KiB: four times the budget
    steps = [{"do": "fill", "slots": list(range(64)), "seed": 3}]
    for start in range(0, 64, 8):
        steps.append(
            {"do": "set", "keys": keys[start : start + 8], "slots": list(range(start, start + 8))}
        )
    steps += [
        {"do": "exists", "keys": keys[-8:]},
        {"do": "exists", "keys": keys},
        {"do": "disk", "root": str(root)},
    ]
    out = run_kit(
        _plan(root, pool, steps, extra=extra_config(root, disk_bytes=budget)), tmp_path, "budget"
    )["steps"]
    assert all(s == [True] * 8 for s in out[1:9]), out[1:9]
    assert out[9] == 8  # the latest pages are there
    assert out[10] == 0  # the first ones were evicted
    assert out[11]["stats"]["store"]["disk_evictions"] > 0
    assert du(root / "kv") <= budget * 1.05


def test_tp_ranks_share_a_namespace_and_keep_their_pages_apart(tmp_path) -> None:
    root, keys, slots = tmp_path / "root", page_keys(4), [0, 1, 2, 3]
    pool = POOLS["mha-page_first"]
    rank0 = {"tp_rank": 0, "tp_size": 2}
    rank1 = {"tp_rank": 1, "tp_size": 2}
    fill_set = [
        {"do": "fill", "slots": slots},
        {"do": "digest", "slots": slots},
        {"do": "set", "keys": keys, "slots": slots},
    ]
    first = run_kit(
        _plan(root, pool, [{**fill_set[0], "seed": 10}, *fill_set[1:]], **rank0), tmp_path, "r0"
    )["steps"]
    second = run_kit(
        _plan(
            root,
            pool,
            [{"do": "exists", "keys": keys}, {**fill_set[0], "seed": 11}, *fill_set[1:]],
            **rank1,
        ),
        tmp_path,
        "r1",
    )["steps"]
    assert second[0] == 0  # rank 0's pages are not rank 1's
    assert second[2] != first[1]
    again = run_kit(
        _plan(
            root,
            pool,
            [{"do": "get", "keys": keys, "slots": slots}, {"do": "digest", "slots": slots}],
            **rank0,
        ),
        tmp_path,
        "r0-again",
    )["steps"]
    assert again == [[True] * 4, first[1]]
    assert len(list((root / "kv").glob("sglang.*"))) == 1  # one namespace, one budget


def test_an_unknown_extra_config_key_is_refused_with_the_closest(tmp_path) -> None:
    root = tmp_path / "root"
    extra = extra_config(root)
    extra["disk_byte"] = extra.pop("disk_bytes")
    out = run_kit(_plan(root, POOLS["mha-page_first"], [], extra=extra), tmp_path, "typo")
    assert "unknown extra-config key 'disk_byte'" in out["build_error"]
    assert "did you mean 'disk_bytes'?" in out["build_error"]
