"""KVStore with CUDA tensors: device put (pinned D2H on a side stream), device get and
batched_get_into (one async H2D per memory hit, the staging ring for disk hits), the
pinned memory tier, and the shared pool registered with CUDA."""

from __future__ import annotations

from pathlib import Path

import torch

from persisting.kv import ChunkKey, open_kv_store

MiB = 1 << 20
DEVICE = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
MODEL = "gpu/store"


def key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, 5000 + i, "bfloat16")


def chunk(seed: int, tokens: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, tokens, 128, generator=g).to(torch.bfloat16)  # 1 MiB at 256


def test_device_put_and_get_are_bit_exact_and_stay_off_pageable_memory(root: Path) -> None:
    values = [chunk(i) for i in range(8)]
    on_device = [v.to(DEVICE) for v in values]
    with open_kv_store(root, MODEL, memory_bytes=4 * MiB, disk_bytes=64 * MiB) as store:
        assert store.stats()["pinned"] is True
        store.batched_put([key(i) for i in range(8)], on_device)
        copier = store.host.copier(DEVICE)
        assert copier.counters["d2h_bytes"] == 8 * MiB
        assert copier.counters["pageable_bytes"] == 0
        # Memory hits (the last four) and disk hits (the first four) in one batch.
        got = store.batched_get([key(i) for i in range(8)] + [key(99)], device=DEVICE)
        assert got[-1] is None
        for g, v in zip(got, values, strict=False):
            assert g.device == DEVICE and torch.equal(g.cpu(), v)
        stats = store.stats()
        assert stats["get_hit_memory"] >= 1 and stats["get_hit_disk"] >= 1
        assert copier.counters["pageable_bytes"] == 0


def test_non_contiguous_device_tensors_are_stored_by_value(root: Path) -> None:
    base = chunk(3).to(DEVICE)
    strided = base.transpose(2, 3)  # [2, 8, 128, 256], not contiguous
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.put(key(0), strided)
        assert torch.equal(store.get(key(0)), strided.cpu().contiguous())


def test_batched_get_into_device_outs_leaves_misses_and_damage_untouched(root: Path) -> None:
    values = [chunk(i) for i in range(6)]
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.batched_put([key(i) for i in range(6)], values)
        assert store.disk is not None
        text = store._key(key(2))
        entry = store.disk.entry(text)
        assert entry is not None
        path = store.disk.files.path(text, entry.tag)
        with open(path, "r+b") as f:
            f.seek(4096 + 10)
            f.write(b"\xff\xff")
        outs = [torch.full_like(v, -1.0, device=DEVICE) for v in values]
        outs.append(torch.full_like(values[0], -1.0, device=DEVICE))
        layouts = store.batched_get_into([key(i) for i in range(6)] + [key(77)], outs)
        torch.cuda.current_stream().synchronize()
        assert [lay is not None for lay in layouts] == [True, True, False, True, True, True, False]
        for i in (2, 6):
            assert bool((outs[i] == -1).all())
        for i in (0, 1, 3, 4, 5):
            assert torch.equal(outs[i].cpu(), values[i])
        # A CPU out in the same batch as a device one.
        cpu_out = torch.empty_like(values[0])
        dev_out = torch.empty_like(values[1], device=DEVICE)
        assert all(store.batched_get_into([key(0), key(1)], [cpu_out, dev_out]))
        assert torch.equal(cpu_out, values[0]) and torch.equal(dev_out.cpu(), values[1])


def test_a_single_get_into_a_device_tensor_is_ordered_before_the_callers_work(
    root: Path,
) -> None:
    value = chunk(5)
    with open_kv_store(root, MODEL, memory_bytes=4 * MiB, disk_bytes=64 * MiB) as store:
        store.put(key(0), value)
        out = torch.zeros_like(value, device=DEVICE)
        assert store.get_into(key(0), out) is not None
        total = out.float().sum()  # queued on the current stream after the copy
        assert float(total) == float(value.float().sum())


def test_the_shared_pool_is_registered_with_cuda(root: Path) -> None:
    with open_kv_store(
        root, MODEL, memory_bytes=8 * MiB, disk_bytes=64 * MiB, shared_memory=True
    ) as store:
        assert store.pool is not None
        assert store.host.pinned
        store.put(key(0), chunk(0))
        got = store.get(key(0), device=DEVICE)
        assert torch.equal(got.cpu(), chunk(0))
