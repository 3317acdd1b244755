"""A prompt longer than the disk budget keeps its first chunks, across a restart, when its
chunks come with their parents (issue 40: ``eviction = "prefix"`` kept nothing reusable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import file_size
from tests.kv.kv_helpers import MODEL, OVERHEAD_ROOM, big, key

PROMPT = [key(i) for i in range(15)]
PARENTS = [None, *PROMPT[:-1]]
#: Room for eleven of the fifteen 1 MiB chunks.
BUDGET = 11 * file_size(big(0).numel() * 2) + OVERHEAD_ROOM


def reused_after_restart(root: Path, eviction: str, batch: bool, reversed_: bool = False) -> int:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=BUDGET, eviction=eviction) as s:
        if batch:
            order = list(range(15))[:: -1 if reversed_ else 1]  # LMCache's adapter: last first
            s.batched_put(
                [PROMPT[i] for i in order],
                [big(i) for i in order],
                parents=[PARENTS[i] for i in order],
            )
        else:  # one store call per block, as an engine saving blocks as they fill
            for i, k in enumerate(PROMPT):
                s.put(k, big(i), parent=PARENTS[i])
        assert s.stats()["disk_evictions"] > 0 or batch
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=BUDGET, eviction=eviction) as s:
        return s.lookup_prefix(PROMPT)


@pytest.mark.parametrize("eviction", ["prefix", "value"])
def test_block_by_block_the_first_chunks_stay(root: Path, eviction: str) -> None:
    # a chunk whose parent is gone goes first (a lookup never reaches it), then the
    # chain's tip: the head of the prompt stays, and hits after the restart
    assert reused_after_restart(root, eviction, batch=False) == 10


@pytest.mark.parametrize("reversed_", [False, True])
@pytest.mark.parametrize("eviction", ["prefix", "value", "lru"])
def test_one_batch_over_the_budget_keeps_its_head(
    root: Path, eviction: str, reversed_: bool
) -> None:
    # the whole batch cannot fit: the budget takes its first chunks by their parents,
    # whatever order the batch lists them in (it used to store none)
    assert reused_after_restart(root, eviction, batch=True, reversed_=reversed_) == 11


def test_lru_without_chains_loses_the_head(root: Path) -> None:
    # what the connector did without parents: the first chunks are the oldest, and go
    assert reused_after_restart(root, "lru", batch=False) == 0


@pytest.mark.parametrize("eviction", ["prefix", "value"])
def test_a_chunk_stored_before_its_parent_is_not_taken_for_an_orphan(
    root: Path, eviction: str
) -> None:
    # parallel writers (SGLang's I/O threads, vLLM's jobs in flight) may store a chunk
    # before its parent: it is not cut off from its prefix, so the older chain goes instead
    old = [key(100 + i) for i in range(10)]
    new = [key(i) for i in range(3)]
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=BUDGET, eviction=eviction) as s:
        for i, k in enumerate(old):
            s.put(k, big(i), parent=old[i - 1] if i else None)
        for i in (2, 1, 0):  # the last first
            s.put(new[i], big(10 + i), parent=new[i - 1] if i else None)
        assert s.stats()["disk_evictions"] == 2
        assert s.lookup_prefix(new) == 3
        assert s.lookup_prefix(old) == 8
