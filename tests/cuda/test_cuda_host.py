"""persisting.cuda on a host without CUDA: the setting's resolution, the fallback, the
carving of a region, and the copy pipeline into CPU tensors (its GPU side: tests_gpu/)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.config import PersistingSettings
from persisting.cuda import (
    DeviceCopier,
    PinnedRegion,
    cuda_available,
    open_region,
    register_host_memory,
    resolve_pinned,
    shared_copier,
)
from persisting.errors import ConfigError, InvalidValueError
from persisting.kv import ChunkKey, Layout, open_kv_store
from persisting.shm import PAGE

MODEL = "test/cuda-host"


def key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, i * 7919 + 1, "bfloat16")


def chunk(seed: int, tokens: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, tokens, 64, generator=g).to(torch.bfloat16)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


# -- the setting ---------------------------------------------------------------------------


def test_pinned_mode_resolves_against_the_cuda_probe() -> None:
    assert resolve_pinned("off", cuda=True) is False
    assert resolve_pinned("auto", cuda=True) is True
    assert resolve_pinned("auto", cuda=False) is False
    assert resolve_pinned("on", cuda=True) is True
    with pytest.raises(ConfigError, match="needs CUDA"):
        resolve_pinned("on", cuda=False)
    with pytest.raises(ConfigError, match="auto, on, off"):
        resolve_pinned("yes")
    # Without an override, this host's real probe decides.
    assert resolve_pinned("auto") is cuda_available()


def test_pinned_settings_come_from_env_and_reject_typos(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = PersistingSettings.load()
    assert settings.kv.pinned_memory == "auto"
    assert settings.kv.pinned_staging_bytes == 256 << 20
    monkeypatch.setenv("PERSISTING_KV__PINNED_MEMORY", "off")
    monkeypatch.setenv("PERSISTING_KV__PINNED_STAGING_BYTES", str(64 << 20))
    settings = PersistingSettings.load()
    assert (settings.kv.pinned_memory, settings.kv.pinned_staging_bytes) == ("off", 64 << 20)
    monkeypatch.setenv("PERSISTING_KV__PINNED_MEMORY", "of")
    with pytest.raises(ConfigError, match="pinned_memory"):
        PersistingSettings.load()


@pytest.mark.skipif(cuda_available(), reason="checks the fallback of a host without CUDA")
def test_without_cuda_nothing_is_pinned_and_device_copies_are_refused() -> None:
    region = open_region(8 * PAGE, "auto")
    assert region is not None and not region.pinned
    with pytest.raises(ConfigError):
        open_region(8 * PAGE, "on")
    assert open_region(0, "auto") is None
    assert register_host_memory(bytearray(PAGE)) is None
    with pytest.raises(ConfigError, match="needs CUDA"):
        PinnedRegion(PAGE, pin=True)
    with pytest.raises(InvalidValueError, match="CUDA"):
        DeviceCopier("cuda")
    with pytest.raises(InvalidValueError, match="unsupported device"):
        DeviceCopier("meta")


# -- the region ----------------------------------------------------------------------------


def test_carved_parts_share_the_region_under_budgets_of_their_own() -> None:
    region = PinnedRegion(10 * PAGE, pin=False)
    tier = region.carve(6 * PAGE)
    ring = region.carve(3 * PAGE)
    assert tier is not None and ring is not None
    assert region.carve(2 * PAGE) is None  # one page left
    assert (tier.capacity, ring.capacity) == (6 * PAGE, 3 * PAGE)
    a = tier.allocate(6 * PAGE)
    assert a is not None and tier.owns(a) and region.owns(a) and not ring.owns(a)
    assert tier.allocate(PAGE) is None  # the tier is full; the ring is not
    b = ring.allocate(2 * PAGE)
    assert b is not None and ring.owns(b) and not tier.owns(b)
    a[:] = 1
    b[:] = 2
    assert int(a.max()) == 1 and int(b.min()) == 2  # disjoint
    del a
    gc.collect()
    assert tier.free_bytes == 6 * PAGE
    assert tier.pinned is False and ring.pinned is False
    ring.close()
    tier.close()
    region.close()


def test_store_host_memory_without_cuda_pins_nothing_and_stages_through_plain_memory() -> None:
    from persisting.cuda import StoreHostMemory

    host = StoreHostMemory(mode="auto", memory_bytes=1 << 20, staging_bytes=4 * PAGE)
    assert host.pin is False and host.pinned is False
    assert host.memory_buffer(PAGE) is None  # the tier allocates as before
    copier = host.copier("cpu")
    assert copier is host.copier(torch.device("cpu"))
    buffer = copier.host_buffer(PAGE)
    assert copier.staging is not None and copier.staging.owns(buffer)
    host.close()
    with pytest.raises(ConfigError, match="needs CUDA"):
        StoreHostMemory(mode="on", memory_bytes=1 << 20, staging_bytes=PAGE)


def test_a_region_hands_out_disjoint_aligned_ranges_that_return_when_garbage() -> None:
    region = PinnedRegion(10 * PAGE, pin=False)
    assert region.capacity == 10 * PAGE and region.free_bytes == 10 * PAGE
    a = region.allocate(3 * PAGE - 5)
    b = region.allocate(PAGE)
    assert a is not None and b is not None
    assert a.nbytes == 3 * PAGE - 5 and a.flags.writeable
    assert a.ctypes.data % PAGE == 0 and b.ctypes.data % PAGE == 0
    assert b.ctypes.data >= a.ctypes.data + 3 * PAGE  # no overlap
    assert region.owns(a) and not region.owns(np.zeros(4, np.uint8))
    a[:] = 7
    b[:] = 9
    assert int(a.max()) == 7 and int(b.min()) == 9
    assert region.free_bytes == 6 * PAGE
    assert region.allocate(7 * PAGE) is None  # no room: None, never an oversized range

    tensor = torch.from_numpy(a).view(torch.int8)[PAGE:]  # a view keeps the range taken
    del a
    gc.collect()
    assert region.free_bytes == 6 * PAGE
    assert int(tensor[0]) == 7
    del tensor, b
    gc.collect()
    assert region.free_bytes == 10 * PAGE
    region.close()
    assert region.allocate(PAGE) is None


# -- copies into CPU tensors (the same pipeline a CUDA device runs asynchronously) ------------


def test_to_host_lands_each_tensor_in_order_even_when_staging_runs_short() -> None:
    region = PinnedRegion(3 * PAGE, pin=False)
    copier = DeviceCopier("cpu", staging=region)
    tensors = [chunk(i, tokens=2).transpose(2, 3) for i in range(6)]  # non-contiguous, 2 KiB
    tensors.append(chunk(99, tokens=16))  # 16 KiB: larger than the whole region
    got = []
    for buffer in copier.to_host(tensors):
        got.append(buffer.copy())  # the caller keeps a copy and drops the buffer
    assert [g.tobytes() for g in got] == [as_bytes(t).tobytes() for t in tensors]
    assert copier.counters["pageable_bytes"] == tensors[-1].numel() * 2
    assert copier.counters["d2h_bytes"] == sum(t.numel() * 2 for t in tensors)
    del got
    gc.collect()
    assert region.free_bytes == 3 * PAGE


def test_to_host_falls_back_to_pageable_when_the_caller_keeps_every_buffer() -> None:
    region = PinnedRegion(2 * PAGE, pin=False)
    copier = DeviceCopier("cpu", staging=region)
    tensors = [chunk(i, tokens=4) for i in range(5)]  # 4 KiB each: two fit in the region
    kept = list(copier.to_host(tensors))  # held: the region cannot take them all
    assert [k.tobytes() for k in kept] == [as_bytes(t).tobytes() for t in tensors]
    assert sum(region.owns(k) for k in kept) == 2
    assert copier.counters["pageable_bytes"] == 3 * 4096


def test_an_abandoned_to_host_gives_every_range_back() -> None:
    region = PinnedRegion(8 * PAGE, pin=False)
    copier = DeviceCopier("cpu", staging=region)
    stream = copier.to_host(chunk(i, tokens=4) for i in range(4))
    first = next(stream)
    assert first.nbytes == 4096
    stream.close()
    del first, stream
    gc.collect()
    assert region.free_bytes == 8 * PAGE


def test_upload_reads_store_chunks_through_a_small_ring_and_never_writes_a_miss(
    tmp_path: Path,
) -> None:
    values = [chunk(i) for i in range(8)]  # 16 KiB each
    region = PinnedRegion(40 << 10, pin=False)  # room for two at a time
    copier = DeviceCopier("cpu", staging=region)
    with open_kv_store(tmp_path, MODEL, memory_bytes=0, disk_bytes=8 << 20) as store:
        store.batched_put([key(i) for i in range(8)], values)
        store.remove(key(5))
        layout = Layout.of(values[0])
        wrong = Layout((2, 4, 16, 32), "bfloat16", "KV_2LTD", 8192)
        reads = [
            (lambda buf, i=i: store.get_into(key(i), buf, expect=layout) is not None)
            for i in range(8)
        ]
        reads[6] = lambda buf: store.get_into(key(6), buf, expect=wrong) is not None
        outs = [torch.full_like(v, 3.0) for v in values]
        done = copier.upload(reads, outs)
    assert done == [True] * 5 + [False, False, True]
    for i in (0, 1, 2, 3, 4, 7):
        assert torch.equal(outs[i], values[i])
    for i in (5, 6):  # a miss and a layout mismatch leave the destination untouched
        assert bool((outs[i] == 3.0).all())
    assert copier.counters["staged_bytes"] == 8 * 16384
    assert copier.counters["pageable_bytes"] == 0
    copier.synchronize()
    gc.collect()
    assert region.free_bytes == region.capacity


def test_to_device_fills_contiguous_and_strided_outs_and_checks_sizes() -> None:
    copier = DeviceCopier("cpu")  # no staging: to_device copies straight from the sources
    values = [chunk(i) for i in range(2)]
    sources = [as_bytes(values[0]), values[1]]  # an array and a CPU tensor
    strided = torch.zeros(2, 4, 64, 16, dtype=torch.bfloat16).transpose(2, 3)
    outs = [torch.empty_like(values[0]), strided]
    copier.to_device(sources, outs)
    assert torch.equal(outs[0], values[0]) and torch.equal(strided, values[1])
    with pytest.raises(InvalidValueError, match="cannot fill"):
        copier.to_device([as_bytes(values[0])[:100]], [torch.empty_like(values[0])])
    with pytest.raises(InvalidValueError, match="sources but"):
        copier.to_device(sources, outs[:1])
    readonly = as_bytes(values[0]).copy()
    readonly.flags.writeable = False  # a read-only pool mapping is a valid source
    copier.to_device([readonly], [outs[0].zero_()])
    assert torch.equal(outs[0], values[0])


def test_shared_copiers_are_made_once_per_device_and_setting() -> None:
    a = shared_copier("cpu", staging_bytes=1 << 20)
    assert shared_copier("cpu", staging_bytes=1 << 20) is a
    assert shared_copier("cpu", staging_bytes=2 << 20) is not a
    assert a.staging is not None and not a.staging.pinned


def test_a_read_that_raises_stops_the_upload_and_gives_its_buffer_back() -> None:
    region = PinnedRegion(8 * PAGE, pin=False)
    copier = DeviceCopier("cpu", staging=region)
    values = [chunk(i, tokens=4) for i in range(3)]
    outs = [torch.zeros_like(v) for v in values]

    def fill(i: int) -> Callable[[np.ndarray], bool]:
        def read(buffer: np.ndarray) -> bool:
            if i == 1:
                raise OSError("disk gone")
            buffer[:] = as_bytes(values[i])
            return True

        return read

    with pytest.raises(OSError, match="disk gone"):
        copier.upload([fill(i) for i in range(3)], outs)
    assert torch.equal(outs[0], values[0])
    assert not outs[1].any() and not outs[2].any()
    copier.synchronize()
    gc.collect()
    assert region.free_bytes == region.capacity
