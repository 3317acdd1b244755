"""Batched reads: disk reads kept in flight by reader threads, ``batched_get_into`` for host
buffers, the staged device path (run here with a ``cpu`` copier), the bandwidth each tier
achieved, and the load-or-recompute plan built on it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.config import KVSettings, PersistingSettings
from persisting.cuda import DeviceCopier, PinnedRegion
from persisting.errors import ConfigError, InvalidValueError
from persisting.kv import ChunkKey, KVStore, TokenHasher, open_kv_store
from persisting.kv.disk.payload_files import HEADER_BYTES
from persisting.metrics import KVMetrics
from tests.kv.kv_helpers import MODEL, key, tensor

MiB = 1 << 20


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


def payload_path(store: KVStore, k: ChunkKey) -> Path:
    where = store.lease(k, 0.0)  # where its bytes are (no lease taken)
    assert where is not None
    return Path(where.path)


def flip_payload_byte(path: Path, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + at)
        byte = f.read(1)
        f.seek(HEADER_BYTES + at)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_a_batched_get_reads_disk_chunks_on_several_reader_threads(root: Path) -> None:
    n = 12
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB, read_threads=4) as s:
        s.batched_put([key(i) for i in range(n)], [tensor(i, tokens=64) for i in range(n)])
        readers: set[str] = set()
        lock = threading.Lock()

        def seen(op: str, tier: str, _s: float, _n: int, outcome: str) -> None:
            if op == "get" and tier == "disk" and outcome == "hit":
                with lock:
                    readers.add(threading.current_thread().name)

        s.op_stats.listeners.append(seen)
        keys = [key(i) for i in range(n)] + [key(999)]
        got = s.batched_get(keys)
        assert got[-1] is None
        for i in range(n):
            assert torch.equal(got[i], tensor(i, tokens=64))
        assert readers and all(name.startswith("persisting-kv-read") for name in readers)
        stats = s.stats()
        assert stats["get_hit_disk"] == n and stats["get_miss"] == 1
        assert stats["read_threads"] == 4
        assert stats["read_bandwidth_disk"] > 0  # the batch's bytes over its wall time


def test_one_read_thread_reads_on_the_callers_thread(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB, read_threads=1) as s:
        s.batched_put([key(i) for i in range(3)], [tensor(i) for i in range(3)])
        readers: set[str] = set()
        s.op_stats.listeners.append(lambda *_a: readers.add(threading.current_thread().name))
        got = s.batched_get([key(i) for i in range(3)])
        assert all(torch.equal(got[i], tensor(i)) for i in range(3))
        assert readers == {threading.current_thread().name}


def test_memory_and_disk_hits_mix_in_one_batch(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=64 * 1024, disk_bytes=64 * MiB) as s:
        s.batched_put([key(i) for i in range(6)], [tensor(i) for i in range(6)])
        in_memory = [i for i in range(6) if s.in_memory(key(i))]
        assert 0 < len(in_memory) < 6  # the small memory tier kept only the latest
        got = s.batched_get([key(i) for i in range(6)])
        assert all(torch.equal(got[i], tensor(i)) for i in range(6))
        stats = s.stats()
        assert stats["get_hit_memory"] == len(in_memory)
        assert stats["get_hit_disk"] == 6 - len(in_memory)
        assert stats["read_bandwidth_memory"] > 0 and stats["read_bandwidth_disk"] > 0


def test_batched_get_into_fills_host_tensors_and_arrays(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as s:
        s.batched_put([key(i) for i in range(4)], [tensor(i) for i in range(4)])
        outs: list[object] = [torch.empty_like(tensor(i)) for i in range(3)]
        outs.append(np.empty(tensor(3).numel() * 2, dtype=np.uint8))
        layouts = s.batched_get_into([key(i) for i in range(4)], outs)
        assert all(layout is not None for layout in layouts)
        assert all(torch.equal(outs[i], tensor(i)) for i in range(3))  # type: ignore[arg-type]
        assert bytes(outs[3]) == tensor(3).view(-1).view(torch.uint8).numpy().tobytes()  # type: ignore[arg-type]
        # A miss is None, the others still served.
        good = torch.empty_like(tensor(1))
        assert s.batched_get_into([key(42), key(1)], [good.clone(), good]) == [None, layouts[1]]
        assert torch.equal(good, tensor(1))
        # A destination of the wrong size is the caller's mistake: a typed error, and no
        # destination of the batch is written.
        wrong = torch.empty(3, dtype=torch.bfloat16)
        untouched = torch.zeros_like(tensor(1))
        with pytest.raises(InvalidValueError, match="buffer of"):
            s.batched_get_into([key(1), key(0)], [untouched, wrong])
        assert not untouched.any()


def test_batched_get_into_checks_every_destination_before_reading(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as s:
        s.put(key(0), tensor(0))
        with pytest.raises(InvalidValueError, match="2 keys but 1 outs"):
            s.batched_get_into([key(0), key(1)], [torch.empty_like(tensor(0))])
        with pytest.raises(InvalidValueError, match="contiguous"):
            s.batched_get_into([key(0)], [torch.empty(2, 4, 64, 16).transpose(2, 3)])
        with pytest.raises(InvalidValueError, match="writable"):
            s.batched_get_into([key(0)], [bytes(tensor(0).numel() * 2)])
        assert s.stats().get("get_hit_disk", 0) == 0


def test_a_damaged_chunk_in_a_parallel_batch_is_a_counted_miss(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB, read_threads=4) as s:
        s.batched_put([key(i) for i in range(6)], [tensor(i) for i in range(6)])
        flip_payload_byte(payload_path(s, key(2)))
        outs = [torch.empty_like(tensor(i)) for i in range(6)]
        layouts = s.batched_get_into([key(i) for i in range(6)], outs)
        assert layouts[2] is None
        assert all(
            layouts[i] is not None and torch.equal(outs[i], tensor(i)) for i in (0, 1, 3, 4, 5)
        )
        assert s.stats()["corruptions"] == 1
        assert not s.contains(key(2))


def test_the_staged_device_path_is_bit_exact_and_leaves_misses_untouched(root: Path) -> None:
    """The device pipeline (memory hits copied up in one go, disk hits read into staging
    by reader threads and sent up in order) with a cpu copier, so it runs here."""
    with open_kv_store(root, MODEL, memory_bytes=48 * 1024, disk_bytes=64 * MiB) as s:
        n = 8
        s.batched_put([key(i) for i in range(n)], [tensor(i) for i in range(n)])
        flip_payload_byte(payload_path(s, key(0)))  # key 0 went to disk only (evicted)
        assert not s.in_memory(key(0)) and s.in_memory(key(n - 1))
        sentinel = torch.full_like(tensor(0), 7.0)
        outs = [sentinel.clone() for _ in range(n + 1)]
        # Staging smaller than the batch: buffers are reused as their copies complete.
        copier = DeviceCopier("cpu", staging=PinnedRegion(3 * 8192, pin=False))
        texts = [str(key(i)) for i in [*range(n), 77]]
        layouts = s._reads.fill_staged(copier, texts, outs)
        assert layouts[0] is None and layouts[n] is None
        assert torch.equal(outs[0], sentinel) and torch.equal(outs[n], sentinel)
        for i in range(1, n):
            assert layouts[i] is not None and torch.equal(outs[i], tensor(i))
        assert copier.counters["h2d_bytes"] == (n - 1) * tensor(0).numel() * 2
        stats = s.stats()
        assert stats["get_hit_memory"] + stats["get_hit_disk"] == n - 1
        assert stats["corruptions"] == 1


def test_batched_get_to_the_cpu_device_returns_the_stored_kind(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as s:
        s.put(key(0), tensor(0))
        (got,) = s.batched_get([key(0)], device="cpu")
        assert torch.equal(got, tensor(0))
        assert torch.equal(s.get(key(0), device=torch.device("cpu")), tensor(0))


def test_read_threads_comes_from_settings_and_is_bounded(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSISTING_KV__READ_THREADS", "3")
    settings = PersistingSettings()
    assert settings.kv.read_threads == 3
    with KVStore.from_settings(
        settings.model_copy(update={"storage_path": root}), MODEL, memory_bytes=0
    ) as s:
        assert s.stats()["read_threads"] == 3
    with pytest.raises(ValueError, match="read_threads"):
        KVSettings(read_threads=0)
    with pytest.raises(ConfigError, match="read_threads"):
        open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=MiB, read_threads=0)


def test_pinned_memory_on_a_host_without_cuda(root: Path) -> None:
    """Nothing is pinned with auto; on refuses clearly and leaves the namespace free."""
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=MiB) as s:
        assert s.stats()["pinned"] is False
    with pytest.raises(ConfigError, match="needs CUDA"):
        open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=MiB, pinned_memory="on")
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=MiB, pinned_memory="off"):
        pass  # the failed open released its hold on the namespace


# -- load or recompute --------------------------------------------------------------------


def _prefix(s: KVStore, n_chunks: int) -> tuple[list[int], TokenHasher]:
    hasher = TokenHasher(MODEL, chunk_size=16)
    tokens = list(range(1000, 1000 + 16 * n_chunks + 5))
    chunks = hasher.process_tokens(tokens)
    s.batched_put([k for _s, _e, k in chunks], [tensor(i) for i in range(len(chunks))], chain=True)
    return tokens, hasher


def test_a_disk_hit_slower_than_recomputing_is_not_loaded(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as s:
        tokens, hasher = _prefix(s, 4)
        assert s.lookup_tokens(tokens, hasher) == 64
        # Never measured: loading is how it gets measured.
        assert s.plan_tokens(tokens, recompute_tokens_per_s=1e6, hasher=hasher).load_tokens == 64
        nbytes = tensor(0).numel() * 2
        s.bandwidth.record("disk", 1 << 30, (1 << 30) / (nbytes / 0.01))  # 10 ms per chunk
        # 16 tokens per chunk: recomputing at 16k tokens/s takes 1 ms < 10 ms to read.
        plan = s.plan_tokens(tokens, recompute_tokens_per_s=16_000, hasher=hasher)
        assert (plan.hit_tokens, plan.load_tokens, plan.recompute_tokens) == (64, 0, 64)
        # At 160 tokens/s recomputing a chunk takes 100 ms: every chunk is worth reading.
        assert s.plan_tokens(tokens, recompute_tokens_per_s=160, hasher=hasher).load_tokens == 64
        stats = s.stats()
        assert stats["load_plan_recompute_tokens"] == 64
        assert stats["load_plan_load_tokens"] == 64 + 64
        assert stats["load_plan_recompute_chunks"] == 4
        metrics = KVMetrics()
        metrics.attach(s)
        text = metrics.render()
        assert "persisting_kv_load_plan_recompute_tokens_total" in text
        assert 'persisting_kv_read_bandwidth_bytes_per_second{model="' in text


def test_memory_hits_are_loaded_where_the_disk_is_too_slow(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as s:
        tokens, hasher = _prefix(s, 3)
        s.batched_get([k for _s, _e, k in hasher.process_tokens(tokens)])  # measured for real
        assert s.stats()["read_bandwidth_memory"] > 0
        # Three 16 KiB reads say little about the memory's speed (the first touch of fresh
        # result pages can dominate them): a gigabyte at 10 GB/s settles it.
        s.bandwidth.record("memory", 1 << 30, (1 << 30) / 10e9)
        s.bandwidth.record("disk", 1 << 30, 1e6)  # a disk slower than anything
        plan = s.plan_tokens(tokens, recompute_tokens_per_s=1e5, hasher=hasher)
        assert plan.load_tokens == 48  # all three chunks are memory hits


def test_a_plan_with_no_hit_is_empty(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as s:
        plan = s.plan_tokens(list(range(40)), recompute_tokens_per_s=1000)
        assert (plan.hit_tokens, plan.load_tokens, plan.load_chunks) == (0, 0, 0)
        with pytest.raises(InvalidValueError, match="positive"):
            s.plan_tokens(list(range(40)), recompute_tokens_per_s=0)


def test_a_lone_large_value_is_read_in_parts_at_once(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too few values to keep the reader threads busy: each is split into block-aligned
    parts read at once (bit-exact, odd sizes too); a truncated file is still a miss."""
    from persisting.kv.disk import range_reads

    real = range_reads._pread_exact
    threads: list[str] = []

    def traced(fd: int, path: object, out: memoryview, offset: int) -> None:
        threads.append(threading.current_thread().name)
        real(fd, path, out, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(range_reads, "_pread_exact", traced)
    value = torch.arange(3 * MiB + 77, dtype=torch.uint8).reshape(1, -1)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB, read_threads=4) as s:
        s.put(key(0), value, fmt="binary", check_shape=False)
        got = s.get(key(0))
        assert torch.equal(got, value)
        assert len(threads) == 3 and all(t.startswith("persisting-kv-read") for t in threads)
        out = torch.empty_like(value)
        assert s.get_into(key(0), out) is not None and torch.equal(out, value)
        os.truncate(payload_path(s, key(0)), HEADER_BYTES + 2 * MiB)
        assert s.get(key(0)) is None
        assert not s.contains(key(0))


def test_large_values_of_a_batch_are_each_read_whole_by_one_reader_thread(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of several large values: each is read by one reader thread in one
    positioned read of the whole value, so several stream at once (bit-exact; a damaged
    one is still a counted miss)."""
    from persisting.kv.disk import range_reads

    real = range_reads._pread_exact
    reads: list[tuple[str, int]] = []
    together = threading.Barrier(2, timeout=30)  # the first two reads wait for each other

    def traced(fd: int, path: object, out: memoryview, offset: int, *args: bool) -> object:
        reads.append((threading.current_thread().name, len(out)))
        if len(reads) <= 2:
            together.wait()
        return real(fd, path, out, offset, *args)  # type: ignore[arg-type]

    values = [torch.full((1, 2 * MiB + 4096 * i), i, dtype=torch.uint8) for i in range(5)]
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB, read_threads=4) as s:
        keys = [key(i) for i in range(5)]
        s.batched_put(keys, values, fmt="binary", check_shape=False)
        flip_payload_byte(payload_path(s, key(3)))
        monkeypatch.setattr(range_reads, "_pread_exact", traced)
        got = s.batched_get(keys)
        assert got[3] is None
        assert all(torch.equal(got[i], values[i]) for i in (0, 1, 2, 4))
        assert sorted(size for _t, size in reads) == sorted(v.numel() for v in values)
        assert all(name.startswith("persisting-kv-read_") for name, _s in reads)
        assert len({name for name, _s in reads}) > 1  # the barrier passed: two at once
        assert s.stats()["corruptions"] == 1
