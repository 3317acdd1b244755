"""KVStore behaviour on real files and Lance datasets: tiers, modes, lookups, policies."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.errors import (
    CapacityError,
    ConfigError,
    InvalidKeyError,
    InvalidValueError,
    StoreClosedError,
)
from persisting.kv import Layout, TokenHasher, open_kv_store
from persisting.lance_store import StorageRoot
from tests.kv.kv_helpers import MODEL, disk_tier, key, memory_tier, tensor

MiB = 1 << 20


def open_store(root: Path, **kw):
    kw.setdefault("memory_bytes", 8 * MiB)
    kw.setdefault("disk_bytes", 64 * MiB)
    return open_kv_store(root, MODEL, **kw)


def test_put_get_torch_numpy_bytes_bit_exact(root: Path) -> None:
    with open_store(root) as store:
        t = tensor(1)
        a = np.arange(2 * 3 * 5, dtype=np.float16).reshape(2, 3, 5)
        res = store.put(key(1), t)
        assert (res.tier, res.durable, res.stored) == ("disk", True, True)
        store.put(key(2, dtype="float16"), a, fmt="KV_2TD")  # torch's name of "half"
        store.put(key(3), b"\x00\x01raw", fmt="binary")
        got = store.get(key(1))
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), t.view(torch.int16))
        got_a = store.get(key(2, dtype="half"))
        assert isinstance(got_a, np.ndarray) and got_a.dtype == np.float16
        assert np.array_equal(got_a, a)
        assert store.get(key(3)) == b"\x00\x01raw"
        got[0, 0, 0, 0] = 123  # the caller owns what it gets back
        assert torch.equal(store.get(key(1)), t)


def test_disk_hits_after_memory_is_gone_and_in_a_new_store(root: Path) -> None:
    t = tensor(2)
    with open_store(root, memory_bytes=0) as store:
        store.put(key(1), t)
        assert store.stats()["memory_items"] == 0
        assert torch.equal(store.get(key(1)), t)
    with open_store(root) as again:
        assert again.contains(key(1))
        assert torch.equal(again.get(key(1)), t)
        assert again.stats()["get_hit_disk"] == 1


def test_non_contiguous_tensors_are_stored_as_their_values(root: Path) -> None:
    with open_store(root) as store:
        t = torch.randn(4, 2, 16, 8).transpose(0, 1)
        assert not t.is_contiguous()
        store.put(key(1, dtype="float32"), t)
        assert torch.equal(store.get(key(1, dtype="float")), t)


def test_layout_mismatch_is_a_miss(root: Path) -> None:
    with open_store(root) as store:
        t = tensor(3)
        store.put(key(1), t)
        right = Layout.of(t, "KV_2LTD")
        assert store.get(key(1), expect=right) is not None
        wrong_shape = Layout((2, 4, 8, 128), "bfloat16", "KV_2LTD", right.nbytes)
        wrong_dtype = Layout(right.shape, "half", "KV_2LTD", right.nbytes)
        wrong_fmt = Layout((2, 4 * 16, 64), "bfloat16", "KV_2TD", right.nbytes)
        for exp in (wrong_shape, wrong_dtype, wrong_fmt):
            assert store.get(key(1), expect=exp) is None
        assert store.stats()["layout_mismatches"] == 3


@pytest.mark.parametrize(
    ("value", "fmt", "error"),
    [
        (torch.empty(2, 0, 4, 4), "KV_2LTD", InvalidValueError),
        (torch.zeros(3, 4, 4, 4), "KV_2LTD", InvalidValueError),  # K/V axis is not 2
        (torch.zeros(2, 4, 4), "KV_2LTD", InvalidValueError),
        (torch.zeros(2, 4, 4), "KV_T2D", InvalidValueError),
        (torch.zeros(2, 2, 4, 4), "NOT_A_FORMAT", InvalidValueError),
        (torch.zeros(2, 2, 2, 2, dtype=torch.complex64), "KV_2LTD", InvalidValueError),
        ([1, 2, 3], "KV_2LTD", InvalidValueError),
        (b"raw", "KV_2LTD", InvalidValueError),
        (torch.zeros(2, 1024, 1024, 8), "KV_2LTD", CapacityError),  # 32 MiB > 16 MiB limit
    ],
)
def test_bad_values_raise_typed_errors_and_store_nothing(root, value, fmt, error) -> None:
    with open_store(root, max_value_bytes=16 * MiB) as store:
        with pytest.raises(error):
            store.put(key(1), value, fmt=fmt)
        assert not store.contains(key(1))


def test_keys_of_another_model_or_malformed_are_refused(root: Path) -> None:
    with open_store(root) as store:
        with pytest.raises(InvalidKeyError):
            store.put(key(1, model="other/model"), tensor(1))
        with pytest.raises(InvalidKeyError):
            store.get("not-a-key")
        with pytest.raises(InvalidKeyError):
            store.contains(f"{MODEL}@1@0@xyz@half")


def test_existing_key_put_is_a_no_op_first_writer_wins(root: Path) -> None:
    with open_store(root) as store:
        first, second = tensor(1), tensor(2)
        assert store.put(key(1), first).stored is True
        again = store.put(key(1), second)
        assert again.stored is False and again.durable is True
        assert torch.equal(store.get(key(1)), first)


def test_lookup_prefix_stops_at_the_first_gap(root: Path) -> None:
    with open_store(root) as store:
        keys = [key(i) for i in range(6)]
        store.batched_put([keys[i] for i in (0, 1, 2, 4, 5)], [tensor(i) for i in (0, 1, 2, 4, 5)])
        assert store.lookup_prefix(keys) == 3
        assert store.lookup_prefix(keys[3:]) == 0
        assert store.lookup_prefix(keys[4:]) == 2
        assert store.lookup_prefix([]) == 0


def test_lookup_prefix_across_tp_ranks_needs_every_piece(root: Path) -> None:
    with open_store(root) as store:
        ranks = [[key(i, worker=w, world=2) for i in range(4)] for w in range(2)]
        store.batched_put(ranks[0], [tensor(i) for i in range(4)])
        store.batched_put(ranks[1][:2] + ranks[1][3:], [tensor(i) for i in (0, 1, 3)])
        assert store.lookup_prefix(ranks[0]) == 4
        assert store.lookup_prefix(ranks) == 2  # rank 1 lacks chunk 2


def test_lookup_tokens_counts_covered_tokens(root: Path) -> None:
    with open_store(root, chunk_size=16) as store:
        hasher = TokenHasher(MODEL, chunk_size=16)
        tokens = list(range(70))
        chunks = hasher.process_tokens(tokens)
        store.batched_put([k for *_, k in chunks[:3]], [tensor(i) for i in range(3)], chain=True)
        assert store.lookup_tokens(tokens) == 48
        assert store.lookup_tokens(tokens[:40]) == 32
        assert store.lookup_tokens([5, *tokens[1:]]) == 0


def test_memory_tier_lru_and_counted_pins(root: Path) -> None:
    value_bytes = tensor(0).numel() * 2
    with open_store(root, memory_bytes=3 * value_bytes, disk_bytes=0, eviction="lru") as store:
        for i in range(3):
            store.put(key(i), tensor(i))
        assert store.pin(key(0)) and store.pin(key(0))
        store.get(key(1))  # 2 is now least recently used (0 is pinned)
        store.put(key(3), tensor(3))
        assert [store.contains(key(i)) for i in range(4)] == [True, True, False, True]
        assert store.unpin(key(0))
        store.put(key(4), tensor(4))  # still pinned once: 1 goes
        assert store.contains(key(0)) and not store.contains(key(1))
        assert store.unpin(key(0)) and not store.unpin(key(0))
        store.put(key(5), tensor(5))
        assert not store.contains(key(0))


def test_remove_respects_pins_unless_forced(root: Path) -> None:
    with open_store(root) as store:
        store.put(key(1), tensor(1))
        store.pin(key(1))
        assert store.remove(key(1), force=False) is False
        assert store.contains(key(1))
        assert store.remove(key(1)) is True
        assert not store.contains(key(1)) and store.get(key(1)) is None
        assert store.batched_remove([key(1), key(2)]) == 0


def test_async_mode_writes_behind_with_callbacks(root: Path) -> None:
    done: list = []
    with open_store(root, durability="async") as store:
        # Holding the directory's usage lock stalls the background writer at its reservation,
        # so the put is observably in flight.
        with disk_tier(store).usage.locked():
            res = store.put(key(1), tensor(1), on_complete=done.append)
            assert (res.tier, res.durable) == ("memory", False)
            assert store.exists_in_put_tasks(key(1))
            assert torch.equal(store.get(key(1)), tensor(1))  # readable from memory already
            assert done == []
        store.flush()
        assert not store.exists_in_put_tasks(key(1))
        assert [(r.tier, r.durable) for r in done] == [("disk", True)]
    with open_store(root, memory_bytes=0) as reopened:
        assert torch.equal(reopened.get(key(1)), tensor(1))


def test_async_burst_is_written_behind_in_batches(root: Path) -> None:
    done: list = []
    with open_store(root, durability="async", memory_bytes=64 * MiB) as store:
        with disk_tier(store).usage.locked():
            for i in range(20):
                store.put(key(i), tensor(i), on_complete=done.append)
        store.flush()
        assert sorted(r.key for r in done) == sorted(str(key(i)) for i in range(20))
        assert all(r.durable for r in done)
        assert store.stats()["disk_items"] == 20
    with open_store(root, memory_bytes=0) as reopened:
        assert all(torch.equal(reopened.get(key(i)), tensor(i)) for i in range(20))


def test_write_back_mode_writes_back_on_eviction_and_close(root: Path) -> None:
    value_bytes = tensor(0).numel() * 2
    with open_store(root, durability="write_back", memory_bytes=2 * value_bytes) as store:
        assert store.durability == "write_back"
        store.put(key(0), tensor(0))
        store.put(key(1), tensor(1))
        assert store.stats()["disk_items"] == 0
        store.put(key(2), tensor(2))  # evicts 0 -> written back (by the write-behind)
        store.flush()
        assert store.stats()["disk_items"] == 1
        assert torch.equal(store.get(key(0)), tensor(0))
    with open_store(root, memory_bytes=0) as reopened:
        assert all(torch.equal(reopened.get(key(i)), tensor(i)) for i in range(3))


def test_prefetch_loads_disk_hits_into_memory(root: Path) -> None:
    with open_store(root, memory_bytes=0) as store:
        store.batched_put([key(i) for i in range(3)], [tensor(i) for i in range(3)])
    with open_store(root) as store:
        assert store.stats()["memory_items"] == 0
        assert store.prefetch([key(0), key(1), key(9)]) == 2
        assert store.stats()["memory_items"] == 2
        assert torch.equal(store.get(key(1)), tensor(1))
        assert store.stats()["get_hit_memory"] == 1


def test_second_sighting_admission_keeps_one_offs_off_disk(root: Path) -> None:
    with open_store(root, admission="second_sighting") as store:
        first = store.put(key(1), tensor(1))
        assert (first.tier, first.durable) == ("memory", False)
        assert store.stats()["disk_items"] == 0
        second = store.put(key(1), tensor(1))
        assert (second.tier, second.durable) == ("disk", True)
        assert store.stats()["disk_items"] == 1


def test_get_into_fills_a_caller_buffer(root: Path) -> None:
    with open_store(root, memory_bytes=0) as store:
        t = tensor(4)
        store.put(key(1), t)
        out = torch.empty_like(t)
        layout = store.get_into(key(1), out.view(-1).view(torch.uint8))
        assert layout == Layout.of(t, "KV_2LTD") and torch.equal(out, t)
        too_small = torch.full((10,), 7, dtype=torch.uint8)
        with pytest.raises(InvalidValueError, match=f"buffer of {t.numel() * 2} bytes"):
            store.get_into(key(1), too_small)  # the caller's mistake, not a miss
        assert bool((too_small == 7).all())
        with pytest.raises(InvalidValueError):
            store.get_into(key(1), bytes(t.numel() * 2))


def test_get_into_one_host_buffer_reads_either_tier_and_counts_it(root: Path) -> None:
    """The single-destination ``get_into`` (its own short path, not a batch of one) still
    copies memory hits, reads and verifies disk hits, refuses another layout untouched,
    and counts each in the store's stats."""
    t = tensor(5)
    with open_store(root, memory_bytes=8 * MiB, durability="write_back") as store:
        store.put(key(1), t)
        out = torch.zeros_like(t)
        assert store.get_into(key(1), out) == Layout.of(t, "KV_2LTD") and torch.equal(out, t)
        assert store.stats()["get_hit_memory"] == 1
        other = Layout((1, *t.shape[1:]), "bfloat16", "KV_2LTD", t.numel(), "torch")
        untouched = torch.zeros_like(t)
        assert store.get_into(key(1), untouched, expect=other) is None
        assert not torch.any(untouched)
        assert store.get_into(key(2), untouched) is None
        assert store.stats()["get_miss"] == 2
    with open_store(root, memory_bytes=0) as store:  # reopened: only the disk has it
        out = torch.zeros_like(t)
        assert store.get_into(key(1), out) == Layout.of(t, "KV_2LTD") and torch.equal(out, t)
        assert store.stats()["get_hit_disk"] == 1


def test_namespaces_listed_and_dropped(root: Path) -> None:
    for model in (MODEL, "Qwen/Qwen2-7B"):
        with open_kv_store(root, model, memory_bytes=MiB, disk_bytes=8 * MiB) as store:
            store.put(key(1, model=model), tensor(1))
    lance_root = StorageRoot(root)
    assert sorted(lance_root.list_models()) == sorted([MODEL, "Qwen/Qwen2-7B"])
    assert lance_root.drop_model("Qwen/Qwen2-7B")
    assert lance_root.list_models() == [MODEL]
    with open_kv_store(root, "Qwen/Qwen2-7B", memory_bytes=MiB, disk_bytes=8 * MiB) as store:
        assert not store.contains(key(1, model="Qwen/Qwen2-7B"))


def test_closed_store_and_bad_settings(root: Path) -> None:
    store = open_store(root)
    store.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.get(key(1))
    with pytest.raises(ConfigError):
        open_store(root, durability="later")
    with pytest.raises(ConfigError):
        open_store(root, durability="async", memory_bytes=0)
    with pytest.raises(ConfigError, match="unknown eviction policy 'random'"):
        open_store(root, eviction="random")
    with pytest.raises(ConfigError, match="unknown admission policy 'never'"):
        open_store(root, admission="never")


def test_async_variants(root: Path) -> None:
    async def scenario() -> None:
        with open_store(root) as store:
            await store.aput(key(1), tensor(1))
            await store.abatched_put([key(2)], [tensor(2)])
            assert await store.acontains(key(2))
            assert await store.alookup_prefix([key(1), key(2), key(3)]) == 2
            assert torch.equal(await store.aget(key(1)), tensor(1))
            assert (await store.abatched_get([key(3)])) == [None]
            assert await store.aremove(key(1))
            assert await store.aprefetch([key(2)]) == 1

    asyncio.run(scenario())


def test_threads_share_a_store(root: Path) -> None:
    errors: list[BaseException] = []
    with open_store(root, memory_bytes=MiB, disk_bytes=16 * MiB) as store:

        def worker(w: int) -> None:
            try:
                for i in range(30):
                    k = key(i % 12)
                    store.put(k, tensor(i % 12))
                    got = store.get(k)
                    assert got is None or torch.equal(got, tensor(i % 12))
                    if i % 5 == w:
                        store.remove(k)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert errors == []


def test_memory_tier_values_reuse_the_pages_of_evicted_ones(root: Path) -> None:
    nbytes = tensor(0).numel() * tensor(0).element_size()
    with open_store(root, memory_bytes=2 * nbytes, disk_bytes=0, pinned_memory="off") as store:
        used: set[int] = set()
        for i in range(12):  # a tier of two values: ten evictions
            store.put(key(i), tensor(i))
            used |= {e.buffer.ctypes.data for _k, e in memory_tier(store).index.items()}
        # A put copies before it evicts, so three ranges take turns; none is fresh memory.
        assert len(used) == 3
        assert store.op_stats.counters["arena_full"] == 0
        assert torch.equal(store.get(key(11)), tensor(11)) and store.get(key(0)) is None


def test_prefault_memory_faults_the_private_tier_in_and_keeps_values(root: Path) -> None:
    with open_store(root, memory_bytes=8 * MiB, pinned_memory="off", durability="async") as store:
        store.put(key(0), tensor(0))
        assert store.prefault_memory()
        assert not store.prefault_memory()  # once per store
        assert store.prefaulted_bytes(wait=True) == 8 * MiB  # the budget; the headroom on demand
        store.put(key(1), tensor(1))
        assert torch.equal(store.get(key(0)), tensor(0))
        assert torch.equal(store.get(key(1)), tensor(1))
    with open_store(root, memory_bytes=0) as store:
        assert not store.prefault_memory()  # no memory tier, nothing to fault in


def test_prefault_memory_maps_a_shared_pool_tier_in(root: Path) -> None:
    """A store serving same-host readers keeps its memory tier in the shared pool: its
    prefault commits and maps the pool's pages (the service does this at start)."""
    with open_store(root, memory_bytes=8 * MiB, pinned_memory="off", shared_memory=True) as store:
        assert store.shared_pool is not None
        store.put(key(0), tensor(0))
        assert store.prefault_memory()
        assert store.prefaulted_bytes(wait=True) == 8 * MiB
        store.put(key(1), tensor(1))
        assert torch.equal(store.get(key(0)), tensor(0))
        assert torch.equal(store.get(key(1)), tensor(1))
