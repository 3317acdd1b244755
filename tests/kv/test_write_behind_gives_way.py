"""The write-behind gives way to reads in flight within a batch, not only before it
(issue 27): a batch already under way when reads begin stops between the pieces of its
files until they end, for a bounded time in all, and still stores every value whole."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from persisting.kv import open_kv_store
from persisting.kv import payload_files as payload_files_module
from persisting.kv import write_behind as write_behind_module
from persisting.kv.payload_files import HEADER_BYTES, PAUSE_PIECE
from persisting.kv.read_activity import ReadActivity
from tests.kv.kv_helpers import MODEL, disk_tier, key

MiB = 1 << 20


def hold_a_read(
    reads: ReadActivity, landing: bool = False
) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """A read (``landing``: a put landing) in flight on another thread until ``leave`` is
    set: (entered, leave, thread)."""
    entered, leave = threading.Event(), threading.Event()

    def reader() -> None:
        with reads.landing() if landing else reads.reading():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=reader)
    thread.start()
    assert entered.wait(5)
    return entered, leave, thread


def test_give_way_returns_at_once_while_nothing_is_read() -> None:
    give_way = ReadActivity().give_way(5.0)
    start = time.monotonic()
    for _ in range(1000):
        give_way()
    assert time.monotonic() - start < 0.5


def test_give_way_waits_for_reads_and_holds_its_job_no_longer_than_its_allowance() -> None:
    reads = ReadActivity()
    _entered, leave, thread = hold_a_read(reads)
    try:
        give_way = reads.give_way(0.3)
        waits = []
        callers = []
        for _ in range(3):  # three threads of one job wait on one allowance
            t = threading.Thread(target=lambda: waits.append(_timed(give_way)))
            t.start()
            callers.append(t)
        for t in callers:
            t.join(5)
        assert len(waits) == 3 and all(w < 1.5 for w in waits)
        assert max(waits) >= 0.25  # they waited while the read was in flight...
        assert _timed(give_way) < 0.1  # ...and the allowance, once spent, is spent
    finally:
        leave.set()
        thread.join()
    fresh = reads.give_way(10.0)
    _entered, leave, thread = hold_a_read(reads)
    threading.Timer(0.3, leave.set).start()
    assert 0.2 <= _timed(fresh) < 5.0  # returns once the read is done
    thread.join()


def _timed(fn: Any) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def test_a_batch_under_way_stops_between_pieces_while_a_read_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first payload piece of a batch starts a read and lets it in; no further piece
    is written until that read ends, and the value is stored whole afterwards."""
    pieces = 6
    value = torch.arange(pieces * PAUSE_PIECE // 2, dtype=torch.int16).view(torch.bfloat16)
    value = value.reshape(2, 1, -1, 1024)
    written: list[float] = []
    read_ended: list[float] = []
    real_write_all = payload_files_module._write_all

    with open_kv_store(
        tmp_path / "root", MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as s:
        reads = s._tiers.reads
        started: list[threading.Thread] = []

        def read_for_a_while() -> None:
            with reads.reading():
                started_read.set()
                time.sleep(0.5)
                read_ended.append(time.monotonic())

        started_read = threading.Event()

        def traced(fd: int, buffers: list[Any], offset: int | None = None) -> None:
            if offset is not None and offset >= HEADER_BYTES:  # a piece of the payload
                written.append(time.monotonic())
                if len(written) == 1:  # the batch is under way: a read begins now
                    reader = threading.Thread(target=read_for_a_while)
                    reader.start()
                    started.append(reader)
                    assert started_read.wait(5)
            real_write_all(fd, buffers, offset)

        monkeypatch.setattr(payload_files_module, "_write_all", traced)
        s.put(key(4), value)
        s.flush()
        for reader in started:
            reader.join()
        assert len(written) == pieces and len(read_ended) == 1
        assert all(at >= read_ended[0] for at in written[1:])  # nothing beside the read
        assert disk_tier(s).entry(s._key(key(4))) is not None
        assert reads.yielded_s >= 0.4
    with open_kv_store(tmp_path / "root", MODEL, memory_bytes=0, disk_bytes=64 * MiB) as s:
        assert torch.equal(s.get(key(4)).view(torch.int16), value.view(torch.int16))


def test_a_batch_read_beside_without_pause_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads that never stop hold each batch back for its allowance only, and a flush (a
    caller waiting for the writes) does not wait for them at all."""
    monkeypatch.setattr(write_behind_module, "YIELD_TO_READS_S", 0.3)
    value = torch.full((2, 1, PAUSE_PIECE // 1024, 1024), 5, dtype=torch.bfloat16)
    with open_kv_store(
        tmp_path / "root", MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as s:
        _entered, leave, thread = hold_a_read(s._tiers.reads)
        try:
            start = time.monotonic()
            s.put(key(5), value)
            while disk_tier(s).entry(s._key(key(5))) is None and time.monotonic() - start < 5:
                time.sleep(0.01)
            assert 0.25 <= time.monotonic() - start < 5.0  # written, once the allowance ran out
            monkeypatch.setattr(write_behind_module, "YIELD_TO_READS_S", 5.0)
            start = time.monotonic()
            s.put(key(6), value)
            s.flush()  # the read is still in flight
            assert time.monotonic() - start < 2.5  # not held for the allowance
            assert disk_tier(s).entry(s._key(key(6))) is not None
        finally:
            leave.set()
            thread.join()


def _held(reads: ReadActivity, mark: str, seconds: float) -> threading.Thread:
    """A thread holding a read (or a put landing) in flight for ``seconds``."""
    _entered, leave, thread = hold_a_read(reads, landing=mark == "landing")
    threading.Timer(seconds, leave.set).start()
    return thread


def test_a_job_that_started_behind_waits_for_reads_but_not_for_puts_landing() -> None:
    """A batch that started with a full batch queued behind it stops for reads between its
    pieces (a read is on a request's critical path), but writes beside puts landing (a
    store written without pause must keep up); one that did not start behind waits for
    both."""
    reads = ReadActivity(linger_s=0.05)
    landing = _held(reads, "landing", 0.6)
    behind = reads.give_way(10.0, enough=lambda: True)
    behind.before()  # a full batch queued while a put lands: it starts at once
    start = time.monotonic()
    behind()
    assert time.monotonic() - start < 0.2  # not held by the landing put
    landing.join()
    read = _held(reads, "read", 0.5)
    start = time.monotonic()
    behind()
    assert 0.3 <= time.monotonic() - start < 3.0  # held until the read ended
    read.join()
    time.sleep(0.1)
    calm = reads.give_way(10.0, enough=lambda: False)
    calm.before()  # started on a quiet store: not behind
    landing = _held(reads, "landing", 0.5)
    start = time.monotonic()
    calm()
    assert 0.3 <= time.monotonic() - start < 3.0  # waits for a landing put as for a read
    landing.join()


def test_a_batch_under_way_holds_its_fsync_while_a_read_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's fsync pushes its pages to the disk, which slows reads beside it as much as
    writing them: a read that begins while the file's last piece is written holds the
    fsync back until it ends, and the value is still durable afterwards."""
    value = torch.arange(PAUSE_PIECE // 2, dtype=torch.int16).view(torch.bfloat16)
    value = value.reshape(2, 1, -1, 1024)  # one piece
    synced: list[float] = []
    read_ended: list[float] = []
    started: list[threading.Thread] = []
    real_write_all = payload_files_module._write_all
    real_fsync = payload_files_module.fsync_fd

    with open_kv_store(
        tmp_path / "root", MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as s:
        reads = s._tiers.reads
        started_read = threading.Event()

        def read_for_a_while() -> None:
            with reads.reading():
                started_read.set()
                time.sleep(0.5)
                read_ended.append(time.monotonic())

        def traced(fd: int, buffers: list[Any], offset: int | None = None) -> None:
            if offset is not None and offset >= HEADER_BYTES and not started:
                reader = threading.Thread(target=read_for_a_while)
                reader.start()
                started.append(reader)
                assert started_read.wait(5)
            real_write_all(fd, buffers, offset)

        def timed_fsync(fd: int) -> None:
            synced.append(time.monotonic())
            real_fsync(fd)

        monkeypatch.setattr(payload_files_module, "_write_all", traced)
        monkeypatch.setattr(payload_files_module, "fsync_fd", timed_fsync)
        s.put(key(5), value)
        deadline = time.monotonic() + 10
        while s.stats().get("pending_puts") and time.monotonic() < deadline:
            time.sleep(0.05)
        for reader in started:
            reader.join()
        assert len(started) == 1 and len(read_ended) == 1
        assert synced and all(at >= read_ended[0] for at in synced)
        assert disk_tier(s).entry(s._key(key(5))) is not None
    with open_kv_store(tmp_path / "root", MODEL, memory_bytes=0, disk_bytes=64 * MiB) as s:
        assert torch.equal(s.get(key(5)).view(torch.int16), value.view(torch.int16))


def test_a_writer_behind_stays_out_of_a_burst_of_reads_not_only_out_of_each_read() -> None:
    """Reads that follow one another within ``linger_s`` are one burst: a writer that is
    behind (a full batch queued) waits for the burst to end, before it starts and between
    its pieces -- let in at every gap between two reads, it slowed the next one (LMCache's
    harness read at 0.67x of LocalDisk that way, 1.12x without)."""
    reads = ReadActivity(linger_s=0.05)
    ended: list[float] = []

    def burst() -> None:
        for _ in range(8):
            with reads.reading():
                time.sleep(0.02)
            time.sleep(0.002)  # the gap between two reads of a burst
        ended.append(time.monotonic())

    for step in ("before", "between pieces"):
        ended.clear()
        give_way = reads.give_way(5.0, enough=lambda: True)  # a full batch queued: behind
        reader = threading.Thread(target=burst)
        reader.start()
        time.sleep(0.03)  # into the burst
        if step == "before":
            give_way.before()
        else:
            give_way._behind = True  # a batch that started behind, now between pieces
            while reads.reads_in_flight:  # caught in a gap between two reads
                time.sleep(0.0005)
            give_way()
        let_in = time.monotonic()
        reader.join()
        assert ended and let_in >= ended[0], step


def test_a_writer_behind_does_not_wait_for_puts_landing_after_they_end() -> None:
    """Puts landing never held a writer that is behind; their end does not either."""
    reads = ReadActivity(linger_s=0.5)
    with reads.landing():
        pass
    give_way = reads.give_way(5.0, enough=lambda: True)
    assert _timed(give_way.before) < 0.2
