"""LanceBackend on real Lance datasets: the Pulsing protocol, flushing, readers, retention."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import lance
import pytest

from persisting.errors import (
    AccessDeniedError,
    ConfigError,
    InvalidValueError,
    OffsetTrimmedError,
    StoreClosedError,
)
from persisting.queue import LanceBackend
from persisting.queue import backend as backend_module
from persisting.queue.backend import WAL_DIR
from tests.queue.queue_helpers import small_records
from tests.timing import HANG_S, ManualClock, wait_until, wait_until_async


def flat(batches: list[list[dict]]) -> list[dict]:
    return [record for batch in batches for record in batch]


async def waiting(backend: LanceBackend) -> bool:
    """Whether a stream of ``backend`` is waiting for records now."""
    return (await backend.stats())["waiters"] > 0


def persisted(backend: LanceBackend) -> int:
    return int(asyncio.run(backend.stats())["persisted_count"])


def offsets_in(backend: LanceBackend) -> list[int]:
    return lance.dataset(str(backend.path)).to_table(columns=["_offset"])["_offset"].to_pylist()


def test_offsets_reads_and_counts_span_buffer_and_dataset(open_backend) -> None:
    backend = open_backend()

    async def go() -> None:
        for record in small_records(0, 3):
            await backend.put(record)
        await backend.put_batch(small_records(3, 7))
        await backend.flush()
        await backend.put_batch(small_records(10, 5))  # still buffered
        assert backend.total_count() == 15
        assert await backend.get(100, 0) == small_records(0, 15)
        assert await backend.get(4, 8) == small_records(8, 4)  # across the flush boundary
        assert await backend.get(10, 15) == []
        assert await backend.get(0, 3) == []
        with pytest.raises(InvalidValueError):
            await backend.get(1, -1)
        stats = await backend.stats()
        assert (stats["persisted_count"], stats["buffer_size"], stats["records"]) == (10, 5, 15)

    asyncio.run(go())


def test_a_flush_appends_one_fragment_and_leaves_old_files_alone(open_backend) -> None:
    backend = open_backend(compact_max_fragments=1000)

    async def go() -> None:
        for batch in range(5):
            await backend.put_batch(small_records(batch * 100, 100))
            data_dir = backend.path / "data"
            before = {p.name: p.stat().st_mtime_ns for p in data_dir.glob("*")}
            await backend.flush()
            after = {p.name: p.stat().st_mtime_ns for p in data_dir.glob("*")}
            assert all(after[name] == mtime for name, mtime in before.items())
            assert len(after) == len(before) + 1

    asyncio.run(go())
    assert len(lance.dataset(str(backend.path)).get_fragments()) == 5
    assert offsets_in(backend) == list(range(500))


def test_get_stream_returns_what_exists_or_waits_for_more(open_backend) -> None:
    backend = open_backend()

    async def go() -> None:
        await backend.put_batch(small_records(0, 5))
        got = [batch async for batch in backend.get_stream(100, 0)]
        assert flat(got) == small_records(0, 5)
        assert [b async for b in backend.get_stream(10, 5, wait=True, timeout=0.2)] == []

        async def later() -> None:
            await wait_until_async(lambda: waiting(backend), "the stream waits")
            await backend.put_batch(small_records(5, 3))

        task = asyncio.create_task(later())
        waited = [b async for b in backend.get_stream(3, 5, wait=True, timeout=30)]
        await task
        assert flat(waited) == small_records(5, 3)

    asyncio.run(go())


def test_a_reader_opened_before_a_flush_sees_it_and_wakes_up(open_backend) -> None:
    writer = open_backend()
    reader = open_backend(read_only=True, poll_interval_s=0.02)

    async def go() -> None:
        assert await reader.get(10, 0) == []
        await writer.put_batch(small_records(0, 4))
        assert await reader.get(10, 0) == []  # only flushed records are visible elsewhere
        await writer.flush()
        await wait_until_async(lambda: reader.total_count() == 4, "the reader sees the flush")
        assert await reader.get(10, 0) == small_records(0, 4)

        async def later() -> None:
            await wait_until_async(lambda: waiting(reader), "the reader's stream waits")
            await writer.put_batch(small_records(4, 2))
            await writer.flush()

        task = asyncio.create_task(later())
        waited = [b async for b in reader.get_stream(2, 4, wait=True, timeout=30)]
        await task
        assert flat(waited) == small_records(4, 2)
        with pytest.raises(AccessDeniedError):
            await reader.put({"id": "x"})

    asyncio.run(go())


def test_auto_flush_by_size_and_by_interval(tmp_path: Path, open_backend) -> None:
    by_size = open_backend(tmp_path / "size", batch_size=10)
    by_time = open_backend(tmp_path / "time", flush_interval_s=0.2)
    asyncio.run(by_size.put_batch(small_records(0, 25)))
    asyncio.run(by_time.put_batch(small_records(0, 3)))
    wait_until(lambda: persisted(by_size) == 25, "a flush by size")
    wait_until(lambda: persisted(by_time) == 3, "a flush by interval")
    assert asyncio.run(by_time.stats())["flushes"] >= 1


def test_close_flushes_and_the_log_holds_only_unflushed_records(bucket_dir, open_backend) -> None:
    backend = open_backend()
    asyncio.run(backend.put_batch(small_records(0, 50)))
    assert asyncio.run(backend.stats())["wal_bytes"] > 50 * 20
    asyncio.run(backend.flush())
    stats = asyncio.run(backend.stats())
    assert stats["wal_bytes"] < 64 and stats["wal_segments"] == 1  # an empty, fresh segment
    asyncio.run(backend.put_batch(small_records(50, 5)))
    backend.close()
    with pytest.raises(StoreClosedError):
        asyncio.run(backend.get(1, 0))
    with pytest.raises(StoreClosedError):
        asyncio.run(backend.put({"id": "late"}))
    reopened = open_backend(read_only=True)
    assert asyncio.run(reopened.get(100, 0)) == small_records(0, 55)


def test_stats_report_records_bytes_flushes_latency_fragments_and_log(open_backend) -> None:
    backend = open_backend()
    asyncio.run(backend.put_batch(small_records(0, 10)))
    asyncio.run(backend.flush())
    asyncio.run(backend.put_batch(small_records(10, 2)))
    stats = asyncio.run(backend.stats())
    assert stats["backend"] == "lance" and stats["durability"] == "wal"
    assert (stats["records"], stats["total_count"], stats["buffer_size"]) == (12, 12, 2)
    assert stats["flushes"] == 1 and stats["flushed_records"] == 10
    assert stats["flush_latency_ms"]["last"] > 0
    assert stats["fragments"] == 1 and stats["versions"] >= 2
    assert stats["bytes"] > 0 and stats["wal_bytes"] > 0 and stats["wal_fsyncs"] >= 1
    assert stats["schema"]["seq"] == "int64"


def test_flush_durability_keeps_no_log(bucket_dir, open_backend) -> None:
    fast = open_backend(durability="flush")
    asyncio.run(fast.put_batch(small_records(0, 5)))
    assert asyncio.run(fast.get(10, 0)) == small_records(0, 5)
    assert asyncio.run(fast.stats())["wal_bytes"] == 0
    assert not (bucket_dir / WAL_DIR).exists()
    fast.close()  # closing flushes
    assert asyncio.run(open_backend(read_only=True).get(10, 0)) == small_records(0, 5)


def test_compaction_and_cleanup_keep_fragments_and_versions_bounded(open_backend) -> None:
    backend = open_backend(compact_max_fragments=4, version_retention_s=0)

    async def go() -> None:
        for batch in range(40):
            await backend.put_batch(small_records(batch * 10, 10))
            await backend.flush()
            backend._worker.wake()

    asyncio.run(go())
    wait_until(lambda: asyncio.run(backend.stats())["fragments"] <= 6, "compaction")
    wait_until(lambda: asyncio.run(backend.stats())["versions"] <= 8, "version cleanup")
    stats = asyncio.run(backend.stats())
    assert stats["compactions"] >= 1
    assert offsets_in(backend) == list(range(400))
    assert asyncio.run(backend.get(400, 0)) == small_records(0, 400)


def test_trimming_never_renumbers_offsets(bucket_dir, open_backend) -> None:
    backend = open_backend()

    async def go() -> None:
        await backend.put_batch(small_records(0, 10))
        await backend.flush()
        await backend.put_batch(small_records(10, 10))
        await backend.flush()
        assert await backend.trim(12) == 12
        assert backend.earliest_offset() == 12
        assert await backend.get(3, 12) == small_records(12, 3)
        with pytest.raises(OffsetTrimmedError, match="earliest offset is 12"):
            await backend.get(5, 0)
        await backend.put({"id": "next"})
        assert backend.total_count() == 21
        assert await backend.trim(100) == 8  # only flushed records go; the buffer stays
        await backend.flush()
        assert await backend.get(1, 20) == [{"id": "next"}]

    asyncio.run(go())
    assert offsets_in(backend) == [20]
    asyncio.run(backend.trim(21))
    backend.close()
    again = open_backend()  # everything trimmed: offsets still continue after 20
    assert (again.total_count(), again.earliest_offset()) == (21, 21)
    asyncio.run(again.put({"id": "after-restart"}))
    asyncio.run(again.flush())
    assert offsets_in(again) == [21]


def test_retention_by_age_and_by_slowest_committed_consumer(
    tmp_path: Path, open_backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock(time.time())  # the records' timestamps and retention's "now"
    monkeypatch.setattr(backend_module, "_now_us", lambda: int(clock() * 1_000_000))
    aged = open_backend(tmp_path / "age", retention_s=60, retention_interval_s=0.1)
    asyncio.run(aged.put_batch(small_records(0, 5)))
    asyncio.run(aged.flush())
    clock.advance(61)  # past the first five's retention, without waiting for it
    asyncio.run(aged.put_batch(small_records(5, 5)))
    asyncio.run(aged.flush())
    wait_until(lambda: aged.earliest_offset() == 5, "retention by age")
    assert asyncio.run(aged.get(10, 5)) == small_records(5, 5)

    consumed = open_backend(
        tmp_path / "consumers", retain_until_consumed=True, retention_interval_s=0.1
    )
    asyncio.run(consumed.put_batch(small_records(0, 20)))
    asyncio.run(consumed.flush())
    asyncio.run(consumed.commit_position("slow", 7))  # (only consumers that committed count)
    asyncio.run(consumed.commit_position("fast", 15))
    wait_until(lambda: consumed.earliest_offset() == 7, "retention up to the slowest")
    assert asyncio.run(consumed.committed_position("slow")) == 7
    assert asyncio.run(consumed.committed_position("nobody")) is None
    asyncio.run(consumed.commit_position("slow", 18))
    wait_until(lambda: consumed.earliest_offset() == 15, "retention up to the next slowest")
    assert asyncio.run(consumed.get(100, 15)) == small_records(15, 5)


def test_options_are_validated_and_default_from_settings(
    open_backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="wal_mode"):
        open_backend(wal_mode=True)
    with pytest.raises(ConfigError, match="durability"):
        open_backend(durability="sometimes")
    with pytest.raises(ConfigError, match="read_batch_size"):
        open_backend(read_batch_size=0)
    monkeypatch.setenv("PERSISTING_QUEUE__DURABILITY", "flush")
    monkeypatch.setenv("PERSISTING_QUEUE__RETENTION_S", "3600")
    backend = open_backend()
    assert backend.config.durability == "flush" and backend.config.retention_s == 3600
    assert open_backend(read_only=True, durability="wal").config.durability == "wal"


def test_the_newest_writer_in_a_process_takes_over_the_bucket(open_backend) -> None:
    first = open_backend()
    asyncio.run(first.put_batch(small_records(0, 3)))
    second = open_backend()  # e.g. a restarted actor system in the same process
    assert first.closed
    assert asyncio.run(second.get(10, 0)) == small_records(0, 3)


def test_tensor_methods_use_offsets_as_global_indexes(open_backend) -> None:
    import numpy as np

    backend = open_backend()

    async def go() -> None:
        result = await backend.put_tensor([{"obs": np.ones(2), "r": 1.0} for _ in range(4)])
        assert result.global_indexes == [0, 1, 2, 3] and result.field_names == ["obs", "r"]
        single = await backend.put_tensor({"obs": np.zeros(2), "r": 0.5}, partition_id="p")
        assert single.global_indexes == [4]
        meta = await backend.get_meta(["obs"], batch_size=3, task_name="train")
        assert meta["global_indexes"] == [0, 1, 2]
        assert (await backend.get_meta(["obs"], 3, "train"))["global_indexes"] == [3, 4]
        assert (await backend.get_meta(["obs"], 3, "eval"))["global_indexes"] == [0, 1, 2]
        await backend.reset_consumption("train")
        await backend.mark_consumed("train", [0, 2])  # what Pulsing's bucket reports
        assert (await backend.get_meta(["obs"], 2, "train"))["global_indexes"] == [1, 3]
        rows = await backend.get_data({"global_indexes": [4, 1, 99]}, fields=["r"])
        assert rows == [{"r": 0.5}, {"r": 1.0}]
        with pytest.raises(InvalidValueError):
            await backend.put_tensor("nope")

    asyncio.run(go())


def test_a_compaction_run_elsewhere_under_a_live_writer_loses_nothing(open_backend) -> None:
    from datetime import timedelta

    from persisting.lance_store import LanceTable

    backend = open_backend(compact_max_fragments=1000)

    async def go() -> None:
        for batch in range(6):
            await backend.put_batch(small_records(batch * 10, 10))
            await backend.flush()
        other = LanceTable(backend.path, lance.dataset(str(backend.path)).schema)
        other.compact()  # what `persisting compact` does to a bucket
        other.cleanup(timedelta(0))  # the writer's current version's files are gone now
        assert await backend.get(100, 0) == small_records(0, 60)
        await backend.put_batch(small_records(60, 5))
        await backend.flush()
        assert await backend.get(100, 0) == small_records(0, 65)

    asyncio.run(go())
    assert offsets_in(backend) == list(range(65))


def test_rows_put_out_of_order_by_an_unsafe_compaction_are_still_read_right(
    bucket_dir, open_backend
) -> None:
    from lance.optimize import Compaction, CompactionOptions

    from persisting.errors import StorageIOError
    from persisting.queue.maintenance import compact_bucket

    writer = open_backend(compact_max_fragments=1000)

    async def fill(first: int, batches: int) -> None:
        for batch in range(first, first + batches):
            await writer.put_batch(small_records(batch * 10, 10))
            await writer.flush()

    asyncio.run(fill(0, 8))
    # A compaction run elsewhere, committed after the writer appended more (what an
    # operator's compaction over a live writer does): Lance puts the merged rows last.
    stale = lance.dataset(str(writer.path))
    plan = Compaction.plan(stale, CompactionOptions(target_rows_per_fragment=1000))
    rewrites = [task.execute(stale) for task in plan.tasks]
    asyncio.run(fill(8, 4))
    Compaction.commit(stale, rewrites)
    assert offsets_in(writer) != list(range(120))  # the rows really are out of order now

    reader = open_backend(read_only=True)
    assert asyncio.run(reader.get(200, 0)) == small_records(0, 120)
    assert asyncio.run(reader.get(15, 75)) == small_records(75, 15)
    writer._data.refresh(force=True)  # as after the cleanup of the version it read
    assert asyncio.run(writer.get(200, 0)) == small_records(0, 120)
    asyncio.run(fill(12, 1))
    assert asyncio.run(writer.get(200, 0)) == small_records(0, 130)

    with pytest.raises(StorageIOError, match="being written by another process"):
        compact_bucket(bucket_dir)  # not while a writer is live
    writer.close()
    assert compact_bucket(bucket_dir) >= 1  # the repair: rows rewritten in offset order
    assert offsets_in(writer) == list(range(130))
    assert asyncio.run(open_backend(read_only=True).get(200, 0)) == small_records(0, 130)


def test_maintain_runs_compaction_cleanup_and_retention_now(open_backend) -> None:
    backend = open_backend(
        compact_max_fragments=4,
        version_retention_s=0,
        retain_until_consumed=True,
        retention_interval_s=3600,  # the background worker will not trim during the test
    )

    async def go() -> None:
        for batch in range(12):
            await backend.put_batch(small_records(batch * 10, 10))
            await backend.flush()
        await backend.commit_position("only", 25)
        done = await backend.maintain()
        assert done["trimmed"] == 25
        stats = await backend.stats()
        assert stats["compactions"] >= 1
        assert stats["fragments"] <= 4 and stats["versions"] <= 3
        assert await backend.get(200, 25) == small_records(25, 95)

    asyncio.run(go())
    with pytest.raises(AccessDeniedError):
        asyncio.run(open_backend(read_only=True).maintain())


def test_a_full_buffer_makes_the_put_flush_first(open_backend) -> None:
    backend = open_backend(max_buffer_records=10)  # no size or interval flush otherwise
    asyncio.run(backend.put_batch(small_records(0, 4)))
    assert asyncio.run(backend.stats())["persisted_count"] == 0
    asyncio.run(backend.put_batch(small_records(4, 8)))
    stats = asyncio.run(backend.stats())
    assert (stats["persisted_count"], stats["buffer_size"]) == (12, 0)


def test_a_log_that_cannot_be_replayed_is_set_aside_not_deleted(bucket_dir, open_backend) -> None:
    from persisting.queue.codec import encode_record
    from persisting.queue.wal import UNREPLAYED_DIR, WriteAheadLog, encode_frame

    log = WriteAheadLog(bucket_dir / WAL_DIR)
    log.start(5)  # offsets 5.. while the dataset holds nothing: 0..4 are missing
    for offset in range(5, 8):
        log.append(encode_frame(offset, 0, encode_record({"id": f"k{offset}"})), 1)
    log.close()
    backend = open_backend()
    assert backend.total_count() == 0
    kept = list((bucket_dir / WAL_DIR / UNREPLAYED_DIR).glob("*.wal"))
    assert len(kept) == 1 and kept[0].stat().st_size > 3 * 20
    asyncio.run(backend.put({"id": "fresh"}))
    asyncio.run(backend.flush())
    assert asyncio.run(backend.get(10, 0)) == [{"id": "fresh"}]


def test_waiting_readers_leave_no_waiter_behind(open_backend) -> None:
    """A read-only backend is never notified: each wait must remove its own future, whether
    it timed out or found records (issue 13: 50 calls left 50 futures)."""
    writer = open_backend()
    reader = open_backend(read_only=True, poll_interval_s=0.01)

    async def go() -> None:
        await writer.put_batch(small_records(0, 3))
        await writer.flush()
        for _ in range(50):  # nothing beyond offset 3: every wait times out
            assert [b async for b in reader.get_stream(5, 3, wait=True, timeout=0.02)] == []
        assert (await reader.stats())["waiters"] == 0
        for offset in range(3, 53):  # every wait is ended by a flush
            await writer.put(small_records(offset, 1)[0])
            await writer.flush()
            got = [b async for b in reader.get_stream(1, offset, wait=True, timeout=30)]
            assert got == [small_records(offset, 1)]
        assert (await reader.stats())["waiters"] == 0
        assert [b async for b in writer.get_stream(5, 53, wait=True, timeout=0.02)] == []
        assert (await writer.stats())["waiters"] == 0

    asyncio.run(go())


def test_a_stream_waits_at_most_its_timeout_in_all(open_backend) -> None:
    """``timeout`` bounds the whole stream: records arriving now and then do not extend it
    (it bounded each wait, so a trickle of records kept a 1 s stream open for as long as
    the trickle lasted)."""
    backend = open_backend()

    async def go() -> None:
        async def trickle() -> None:
            for i in range(1_000_000):  # a record now and then, for as long as the stream lasts
                await asyncio.sleep(0.05)  # real duration: the trickle is the case tested
                await backend.put(small_records(i, 1)[0])

        async def stream() -> list[list[dict]]:
            return [b async for b in backend.get_stream(1000, 0, wait=True, timeout=0.5)]

        feeder = asyncio.create_task(trickle())
        try:  # a timeout per wait would keep the stream open for as long as the trickle
            got = flat(await asyncio.wait_for(stream(), HANG_S))
        finally:
            feeder.cancel()
        assert got and got == small_records(0, len(got))

    asyncio.run(go())


def test_versions_stay_few_at_any_flush_rate(open_backend) -> None:
    """Every flush adds a version; deleting versions only by age kept every version of the
    last 10 s (hundreds at a high flush rate), and each one made later commits slower
    (issue 17). Versions followed only by appends go at once."""
    backend = open_backend(compact_max_fragments=1000)  # version_retention_s: 10 s

    async def go() -> None:
        for batch in range(40):
            await backend.put_batch(small_records(batch * 10, 10))
            await backend.flush()
        await backend.maintain()
        assert (await backend.stats())["versions"] <= 2
        assert await backend.get(400, 0) == small_records(0, 400)

    asyncio.run(go())
    assert len(list((backend.path / "_versions").glob("*.manifest"))) <= 2


def test_a_reader_of_a_version_before_a_compaction_keeps_its_files(open_backend) -> None:
    """A compaction replaces files; the version it started from is kept for
    ``version_retention_s``, so a reader still on an older version finds every file it
    lists, while the versions between (appends only) are deleted at once."""
    writer = open_backend(compact_max_fragments=4, version_retention_s=60)

    async def go() -> None:
        for batch in range(3):
            await writer.put_batch(small_records(batch * 10, 10))
            await writer.flush()
        held = lance.dataset(str(writer.path))  # a reader on the version of 3 flushes
        for batch in range(3, 12):
            await writer.put_batch(small_records(batch * 10, 10))
            await writer.flush()
        await writer.maintain()
        stats = await writer.stats()
        assert stats["compactions"] >= 1
        assert stats["versions"] <= 2 + stats["compactions"], stats["versions"]
        files = [
            writer.path / "data" / f.path
            for fragment in held.get_fragments()
            for f in fragment.data_files()
        ]
        assert files and all(f.exists() for f in files)
        assert held.to_table(columns=["_offset"])["_offset"].to_pylist() == list(range(30))

    asyncio.run(go())
