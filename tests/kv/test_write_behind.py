"""The write-behind's one rule (issue 38, item 3): a low-priority writer, two bounds (the
lag a value may wait, the bytes that may wait) past which the writes go on at normal
priority and puts wait, and nobody who waits for the writes -- a flush, a close, a put
over the bound -- waits for the low-priority writer: a batch it is writing is handed over.

The low-priority threads are held by hand here (``lower=``, what each of them runs first),
so each test shows the normal-priority path doing the work on its own, deterministically.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from persisting.kv import PutResult, open_kv_store
from persisting.kv.disk.tier import DiskTier, WriteItem
from persisting.kv.disk.write_behind import BACKGROUND_NICE, Bounds, WriteBehind
from persisting.kv.eviction.policy import eviction_policy
from persisting.kv.layout import encode_value
from persisting.lance_store import StorageRoot
from tests.kv.kv_helpers import MODEL, in_flight, key, tensor
from tests.timing import ManualClock, finishes, wait_until

MiB = 1 << 20


class Held:
    """A ``lower`` hook that holds the write-behind's low-priority threads (the writer,
    or only its file-writing threads) until :meth:`release`."""

    def __init__(self, *, files_only: bool = False):
        self.files_only = files_only
        self.entered = threading.Event()
        self._go = threading.Event()

    def __call__(self) -> None:
        if self.files_only and "-file" not in threading.current_thread().name:
            return
        self.entered.set()
        self._go.wait()

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def disk(root: Path) -> Iterator[DiskTier]:
    storage = StorageRoot(root)
    directory = storage.make_kv_dir(MODEL)
    tier = DiskTier(directory, 64 * MiB, eviction_policy("lru"), keys=storage.kv_keys())
    yield tier
    tier.close()


def item(i: int) -> WriteItem:
    layout, view = encode_value(tensor(i), "KV_2LTD", check_shape=True)
    return WriteItem(str(key(i)), layout, view, xxhash.xxh3_64_intdigest(view), None)


VALUE_BYTES = item(0).layout.nbytes


def done(_item: WriteItem, _stored: bool, _error: BaseException | None) -> None:
    """A completion hook with nothing to tell."""


def test_a_flush_does_not_wait_for_the_low_priority_writer(disk: DiskTier) -> None:
    held = Held()
    writer = WriteBehind(disk, done, lower=held)
    try:
        futures = [writer.submit(item(i)) for i in range(3)]
        assert finishes(writer.drain)  # written at normal priority, the low writer held
        assert [f.result() for f in futures] == [True, True, True]
        assert all(str(key(i)) in disk for i in range(3)) and writer.handovers == 0
    finally:
        held.release()
        writer.close()


def test_a_value_waits_for_the_low_priority_writer_at_most_the_lag(disk: DiskTier) -> None:
    held, clock = Held(), ManualClock()
    writer = WriteBehind(disk, done, Bounds(lag_s=0.05), clock=clock, lower=held)
    try:
        future = writer.submit(item(1))
        assert not writer.urgent and writer.pending_bytes == VALUE_BYTES
        clock.advance(0.05)  # the value has waited the lag: the writes become urgent
        wait_until(future.done, "the value written once it waited the lag")
        assert future.result() and str(key(1)) in disk and writer.pending_bytes == 0
        assert not writer.urgent
    finally:
        held.release()
        writer.close()


def test_puts_wait_while_more_than_the_byte_bound_is_pending(disk: DiskTier) -> None:
    held = Held()
    writer = WriteBehind(disk, done, Bounds(max_bytes=2 * VALUE_BYTES), lower=held)
    try:
        for i in range(5):
            assert finishes(writer.throttle)  # what a put does first
            writer.submit(item(i))
            assert writer.pending_bytes <= 3 * VALUE_BYTES  # the bound, and this value
        assert finishes(writer.throttle)
        assert writer.pending_bytes <= 2 * VALUE_BYTES
        assert sum(str(key(i)) in disk for i in range(5)) >= 3  # written by the due writer
    finally:
        held.release()
        writer.close()


def test_a_low_priority_batch_is_handed_over_to_a_flush(disk: DiskTier) -> None:
    """The low writer has taken a batch (its file writers held before their first piece)
    when a flush comes: at the next piece the batch goes back, unpublished, and the flush's
    normal-priority writer writes it."""
    held = Held(files_only=True)
    writer = WriteBehind(disk, done, lower=held)
    try:
        futures = [writer.submit(item(i)) for i in range(3)]
        wait_until(held.entered.is_set, "the low writer inside its batch")
        flushing = threading.Thread(target=writer.drain)
        flushing.start()
        wait_until(lambda: writer.urgent, "the flush waiting")
        held.release()
        flushing.join(60)
        assert not flushing.is_alive()
        assert writer.handovers == 1
        assert [f.result() for f in futures] == [True, True, True]
        assert all(str(key(i)) in disk for i in range(3))
        assert in_flight(disk.directory) == []  # the abandoned files were removed
    finally:
        held.release()
        writer.close()


def test_a_disk_read_keeps_the_low_priority_writer_off_the_disk(disk: DiskTier) -> None:
    clock = ManualClock()  # never moved: the lag is never reached
    writer = WriteBehind(disk, done, clock=clock)
    try:
        with writer.reading():  # a get reading from the disk
            future = writer.submit(item(1))
            wait_until(lambda: writer.deferrals == 1, "the low writer waiting for the read")
            assert not future.done()
        wait_until(future.done, "the value written once the read ended")
        assert future.result() and writer.handovers == 0
    finally:
        writer.close()


def test_a_batch_under_way_waits_between_pieces_for_a_disk_read(disk: DiskTier) -> None:
    held, clock = Held(files_only=True), ManualClock()
    writer = WriteBehind(disk, done, clock=clock, lower=held)
    try:
        with writer.reading():  # nothing taken meanwhile: the three make one batch
            futures = [writer.submit(item(i)) for i in range(3)]
        wait_until(held.entered.is_set, "the low writer inside its batch")
        before = writer.deferrals
        with writer.reading():
            held.release()  # its files reach their first piece while the read runs
            wait_until(lambda: writer.deferrals > before, "the batch waiting between pieces")
            assert not any(f.done() for f in futures)
        for future in futures:
            wait_until(future.done, "the batch written once the read ended")
        assert all(f.result() for f in futures) and writer.handovers == 0
    finally:
        held.release()
        writer.close()


def test_a_disk_read_keeps_the_writes_back_at_most_the_lag(disk: DiskTier) -> None:
    clock = ManualClock()
    writer = WriteBehind(disk, done, Bounds(lag_s=0.05), clock=clock)
    try:
        with writer.reading():  # reads that never end
            future = writer.submit(item(1))
            wait_until(lambda: writer.deferrals == 1, "the low writer waiting for the read")
            clock.advance(0.1)  # past the lag: written at normal priority, read or not
            wait_until(future.done, "the value written once it waited the lag")
        assert future.result()
    finally:
        writer.close()


def nice_of(name: str) -> int:
    thread = next(t for t in threading.enumerate() if t.name == name)
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread nice is Linux's")
def test_the_low_priority_writer_runs_at_the_lowest_cpu_priority(root: Path) -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with open_kv_store(
        root, MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as store:
        store.put(key(1), tensor(1))
        store.flush()
        assert nice_of("persisting-kv-write-behind") == BACKGROUND_NICE
        assert nice_of("persisting-kv-write-behind-due") == mine  # the urgent writer


def test_a_write_back_eviction_is_written_by_the_write_behind(root: Path) -> None:
    told: list[tuple[str, PutResult]] = []

    def tell(result: PutResult) -> None:
        told.append((threading.current_thread().name, result))

    value_bytes = tensor(0).numel() * 2
    with open_kv_store(
        root, MODEL, memory_bytes=2 * value_bytes, disk_bytes=64 * MiB, durability="write_back"
    ) as store:
        for i in range(3):
            store.put(key(i), tensor(i), on_complete=tell)  # the third evicts key 0
        store.flush()
        assert [r for _t, r in told] == [PutResult(str(key(0)), "disk", True, True)]
        assert told[0][0].startswith("persisting-kv-write-behind")  # not this thread
        assert torch.equal(store.get(key(0)), tensor(0))
