"""persisting.cuda on a CUDA device: page-locking, stream ordering, the staging ring."""

from __future__ import annotations

import gc
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.cuda import (
    DeviceCopier,
    HostRegistration,
    PinnedRegion,
    open_region,
    register_host_memory,
    resolve_pinned,
)
from persisting.errors import StorageIOError
from persisting.kv import ChunkKey, Layout, open_kv_store
from persisting.shm import create_shm_file

MiB = 1 << 20
DEVICE = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
#: GPU clock cycles of a stall queued before a copy (tens of milliseconds on an H200).
STALL = 200_000_000


def chunk(seed: int, tokens: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, tokens, 128, generator=g).to(torch.bfloat16)  # 1 MiB at 256


def pinned(array: np.ndarray) -> bool:
    return torch.from_numpy(array).is_pinned()


def test_auto_pins_here_and_a_region_is_page_locked_until_closed() -> None:
    assert resolve_pinned("auto") is True
    region = open_region(16 * MiB, "on")
    assert region is not None and region.pinned
    a = region.allocate(3 * MiB)
    assert a is not None and pinned(a)
    region.close()
    assert not region.pinned and not pinned(a)  # unregistered; still valid memory
    a[:] = 1


def shm_file(size: int) -> tuple[Path, int]:
    """A /dev/shm file like the shared pool's, its pages committed (path, fd)."""
    path, fd = create_shm_file("persisting-gputest-", size)
    os.posix_fallocate(fd, 0, size)
    return path, fd


def test_existing_mappings_are_registered_and_refusals_leave_no_error_behind() -> None:
    path, fd = shm_file(8 * MiB)
    shared = mmap.mmap(fd, 8 * MiB)
    os.close(fd)
    path.unlink()
    registration = register_host_memory(shared, offset=MiB, nbytes=4 * MiB)
    assert registration is not None and registration.owned
    view = np.frombuffer(shared, np.uint8, count=4 * MiB, offset=MiB)
    assert pinned(view)
    # The same range again: someone else's registration, left to them.
    again = HostRegistration(shared, offset=MiB, nbytes=4 * MiB)
    assert not again.owned
    again.unregister()
    assert pinned(view)
    registration.unregister()
    assert not pinned(view)
    del view

    # Memory the driver cannot lock: a clear error, and no stale CUDA error for the next
    # kernel launch to trip over.
    unusable = mmap.mmap(-1, MiB, prot=0)  # PROT_NONE (not named by mmap before 3.13)
    with pytest.raises(StorageIOError, match="cudaHostRegister"):
        HostRegistration(unusable)
    assert register_host_memory(unusable) is None
    x = torch.ones(1024, device=DEVICE)
    assert float((x * 2).sum()) == 2048.0


def test_a_read_only_mapping_is_registered_or_refused_cleanly() -> None:
    """A same-host client maps the server's pool read-only (cudaHostRegisterReadOnly)."""
    data = np.arange(MiB, dtype=np.uint32).view(np.uint8)
    path, fd = shm_file(4 * MiB)
    os.pwrite(fd, data.tobytes(), 0)
    readonly = mmap.mmap(fd, 4 * MiB, prot=mmap.PROT_READ)
    os.close(fd)
    path.unlink()
    registration = register_host_memory(readonly, read_only=True)
    source = np.frombuffer(readonly, np.uint8)
    out = torch.empty(4 * MiB, dtype=torch.uint8, device=DEVICE)
    DeviceCopier(DEVICE).to_device([source], [out])
    assert torch.equal(out.cpu(), torch.from_numpy(data))
    print(f"read-only registration: {'pinned' if registration else 'refused, pageable'}")
    if registration is not None:
        assert pinned(source)
        registration.unregister()


def test_to_host_waits_for_the_producer_and_lands_in_pinned_staging() -> None:
    region = PinnedRegion(8 * MiB, pin=True)
    copier = DeviceCopier(DEVICE, staging=region)
    x = torch.empty(MiB, dtype=torch.uint8, device=DEVICE)
    torch.cuda._sleep(STALL)  # the producer is slow...
    x.fill_(7)  # ...and queued on the caller's stream just before the copy
    odd = chunk(1).to(DEVICE).transpose(2, 3)  # non-contiguous, made contiguous on the device
    landed = list(copier.to_host([x, odd]))
    assert bool((landed[0] == 7).all())
    assert (
        landed[1].tobytes()
        == odd.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    )
    assert all(region.owns(a) and pinned(a) for a in landed)
    assert copier.counters["pageable_bytes"] == 0


def test_uploads_run_after_the_callers_earlier_work_and_before_its_later_work() -> None:
    copier = DeviceCopier(DEVICE, staging=PinnedRegion(8 * MiB, pin=True))
    out = torch.empty(MiB, dtype=torch.uint8, device=DEVICE)
    torch.cuda._sleep(STALL)
    out.fill_(1)  # earlier work on the caller's stream writes the destination

    def read(buffer: np.ndarray) -> bool:
        buffer[:] = 2
        return True

    assert copier.upload([read], [out]) == [True]
    total = out.sum(dtype=torch.int64)  # later work, queued with no host wait
    assert int(total) == 2 * MiB


def test_a_source_stays_reserved_until_its_copy_has_run() -> None:
    region = PinnedRegion(4 * MiB, pin=True)
    copier = DeviceCopier(DEVICE, staging=region)
    source = region.allocate(4 * MiB)
    assert source is not None
    source[:] = 5
    out = torch.empty(4 * MiB, dtype=torch.uint8, device=DEVICE)
    torch.cuda._sleep(STALL)  # the copy cannot start for a while
    copier.to_device([source], [out])
    del source
    gc.collect()
    assert region.allocate(MiB) is None  # still held by the copy in flight
    torch.cuda.synchronize()
    assert bool((out == 5).all())
    copier.synchronize()
    gc.collect()
    assert region.free_bytes == region.capacity


def test_the_ring_streams_disk_chunks_up_and_leaves_misses_untouched(root: Path) -> None:
    model = "gpu/ring"
    keys = [ChunkKey(model, 1, 0, 1000 + i, "bfloat16") for i in range(10)]
    values = [chunk(i) for i in range(10)]
    region = PinnedRegion(3 * MiB, pin=True)  # three chunks at a time
    copier = DeviceCopier(DEVICE, staging=region)
    with open_kv_store(root, model, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.batched_put(keys, values)
        store.remove(keys[4])
        layout = Layout.of(values[0])
        reads = [(lambda buf, k=k: store.get_into(k, buf, expect=layout) is not None) for k in keys]
        outs = [torch.full(v.shape, -1.0, dtype=v.dtype, device=DEVICE) for v in values]
        done = copier.upload(reads, outs)
    assert done == [i != 4 for i in range(10)]
    for i, (out, value) in enumerate(zip(outs, values, strict=True)):
        if i == 4:
            assert bool((out == -1).all())
        else:
            assert torch.equal(out.cpu(), value)
    strided = torch.zeros(2, 8, 128, 256, dtype=torch.bfloat16, device=DEVICE).transpose(2, 3)
    copier.to_device([values[0]], [strided])
    assert torch.equal(strided.cpu(), values[0])
    assert copier.counters["staged_bytes"] == 9 * MiB + MiB  # the miss read into staging too
    assert copier.counters["pageable_bytes"] == 0


def test_copies_issued_before_a_failing_read_still_precede_the_callers_work() -> None:
    copier = DeviceCopier(DEVICE, staging=PinnedRegion(8 * MiB, pin=True))
    outs = [torch.zeros(MiB, dtype=torch.uint8, device=DEVICE) for _ in range(2)]

    def good(buffer: np.ndarray) -> bool:
        buffer[:] = 3
        return True

    def bad(buffer: np.ndarray) -> bool:
        raise OSError("disk gone")

    torch.cuda._sleep(STALL)  # the first copy waits behind this on the side stream
    with pytest.raises(OSError, match="disk gone"):
        copier.upload([good, bad], outs)
    assert int(outs[0].sum(dtype=torch.int64)) == 3 * MiB  # queued after the copy
    assert int(outs[1].sum(dtype=torch.int64)) == 0
