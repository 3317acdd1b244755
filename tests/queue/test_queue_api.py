"""Registration with Pulsing, the protocol's exact signatures, topic paths, consumers,
compaction planning and consumer positions."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import numpy as np
import pytest
from pulsing.streaming import MemoryBackend, StorageBackend, get_backend_class

from persisting.errors import InvalidNameError, InvalidValueError, OffsetTrimmedError
from persisting.lance_store import StorageRoot
from persisting.queue import (
    LanceBackend,
    QueueConsumer,
    TopicReader,
    close_all,
    open_bucket,
    open_reader,
    open_writer,
    register,
    topic_storage_path,
)
from persisting.queue.maintenance import (
    FragmentStats,
    VersionKeeper,
    compaction_levels,
    plan_compaction,
)
from persisting.queue.positions import ConsumerPositions
from tests.queue.queue_helpers import small_records
from tests.timing import HANG_S, wait_until_async

PROTOCOL_METHODS = [
    "put",
    "put_batch",
    "get",
    "get_stream",
    "flush",
    "stats",
    "total_count",
    "put_tensor",
    "get_data",
    "get_meta",
]


def test_register_makes_every_name_resolve_to_the_backend() -> None:
    assert register() == ("lance", "persisting", "LanceBackend")
    for name in ("lance", "persisting", "LanceBackend"):
        assert get_backend_class(name) is LanceBackend


def test_the_backend_matches_pulsings_storage_backend_protocol(open_backend) -> None:
    backend = open_backend()
    assert isinstance(backend, StorageBackend)
    for name in PROTOCOL_METHODS:
        ours, theirs = getattr(LanceBackend, name), getattr(StorageBackend, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(theirs).parameters
        ), name
        for param in inspect.signature(theirs).parameters.values():
            assert inspect.signature(ours).parameters[param.name].default == param.default, name
        # Called the way Pulsing's own MemoryBackend answers: get_stream is an async
        # generator (Pulsing iterates it with ``async for``), total_count is plain.
        reference = getattr(MemoryBackend, name)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(reference), name
        assert inspect.isasyncgenfunction(ours) == inspect.isasyncgenfunction(reference), name
    constructor = inspect.signature(LanceBackend)
    assert list(constructor.parameters)[:3] == ["bucket_id", "storage_path", "batch_size"]
    assert constructor.parameters["batch_size"].default == 100


def test_topic_paths_follow_the_storage_root_layout(tmp_path: Path) -> None:
    store = StorageRoot(tmp_path)
    path = topic_storage_path(tmp_path, "meta-llama/Llama-3-8B")
    assert Path(path) / "bucket_3" / "data.lance" == store.queue_path("meta-llama/Llama-3-8B", 3)
    assert Path(topic_storage_path(tmp_path, "a/b")) != Path(topic_storage_path(tmp_path, "a_b"))
    with pytest.raises(InvalidNameError):
        topic_storage_path(tmp_path, "")


def test_pulsing_queue_writes_and_reads_through_the_lance_backend(tmp_path: Path) -> None:
    import pulsing as pul

    root, topic = tmp_path / "root", "prewarm/events"

    async def go() -> list[dict]:
        system = await pul.actor_system()
        try:
            writer = await open_writer(
                system, topic, storage_root=root, num_buckets=2, batch_size=1000
            )
            for i in range(20):
                await writer.put({"id": f"k{i}", "seq": i, "vec": np.arange(3) * i})
            await writer.flush()
            reader = await open_reader(system, topic, storage_root=root, num_buckets=2)
            return await reader.get(limit=100)
        finally:
            close_all()  # Pulsing never closes a bucket's backend
            await system.shutdown()

    got = asyncio.run(go())
    assert sorted(r["seq"] for r in got) == list(range(20))
    assert all(np.array_equal(r["vec"], np.arange(3) * r["seq"]) for r in got)
    store = StorageRoot(root)
    stored = [
        open_bucket(root, topic, b, read_only=True)
        for b in (0, 1)
        if store.queue_path(topic, b).is_dir()
    ]
    try:
        assert sum(b.total_count() for b in stored) == 20
    finally:
        for backend in stored:
            backend.close()


def test_a_waiting_reader_waits_at_most_its_timeout_over_all_buckets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pulsing's reader gave each of 4 buckets the whole timeout (4 x 1 s for nothing) and
    waited on a bucket that had a record for more (4 x 2 s for one record): this one only
    ever asks its buckets what they hold now, and returns as soon as a record is there."""
    import pulsing as pul

    root, topic = tmp_path / "root", "waits"
    never = HANG_S * 100  # a timeout no wait below may reach: each returns on a record

    async def go() -> None:
        system = await pul.actor_system()
        try:
            writer = await open_writer(system, topic, storage_root=root, num_buckets=4)
            reader = await open_reader(system, topic, storage_root=root, num_buckets=4)
            assert isinstance(reader, TopicReader)
            asked: list[dict] = []
            ask = reader.reader.get

            async def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
                asked.append(kwargs)
                return await ask(*args, **kwargs)

            monkeypatch.setattr(reader.reader, "get", spy)
            assert await reader.get(limit=10) == []

            got = await asyncio.wait_for(reader.get(limit=100, wait=True, timeout=0.5), HANG_S)
            assert got == [] and asked
            assert not any("wait" in kw or "timeout" in kw for kw in asked)  # no bucket waits

            await writer.put({"id": "one", "seq": 1})
            got = await asyncio.wait_for(reader.get(limit=100, wait=True, timeout=never), HANG_S)
            assert got == [{"id": "one", "seq": 1}]

            async def later() -> None:
                await wait_until_async(lambda: len(asked) > seen, "the reader waits")
                await writer.put({"id": "two", "seq": 2})

            seen = len(asked) + 1  # the reader's first look finds nothing: it then waits
            task = asyncio.create_task(later())
            got = await asyncio.wait_for(reader.get(limit=100, wait=True, timeout=never), HANG_S)
            await task
            assert got == [{"id": "two", "seq": 2}]
            assert await reader.get(limit=100) == []  # the reader moved past both
        finally:
            close_all()
            await system.shutdown()

    asyncio.run(go())


def test_a_consumer_starts_where_asked_and_survives_trimming(bucket_dir, open_backend) -> None:
    writer = open_backend()
    asyncio.run(writer.put_batch(small_records(0, 10)))
    asyncio.run(writer.flush())

    async def go() -> None:
        latest = QueueConsumer(writer, "tail", start="latest")
        assert await latest.poll(10) == []
        earliest = QueueConsumer(writer, "head")
        assert [offset for offset, _ in await earliest.poll(4)] == [0, 1, 2, 3]
        await earliest.commit()
        await writer.trim(6)
        strict = QueueConsumer(writer, "head", on_trimmed="error")  # resumes at 4: trimmed
        with pytest.raises(OffsetTrimmedError):
            await strict.poll(4)
        lenient = QueueConsumer(writer, "head")
        assert [offset for offset, _ in await lenient.poll(10)] == [6, 7, 8, 9]
        assert lenient.skipped == 2

    asyncio.run(go())


def test_compaction_plan_merges_the_lowest_full_level_and_spares_large_fragments() -> None:
    levels = compaction_levels(1 << 20)
    assert levels == [2048, 16384, 131072, 1 << 20]
    few = [FragmentStats(i, 1000) for i in range(4)]
    assert plan_compaction(few, max_small=4, target_rows=1 << 20) is None
    big = [FragmentStats(100 + i, 1 << 20) for i in range(3)]
    mid = [FragmentStats(200 + i, 20_000) for i in range(3)]
    small = [FragmentStats(300 + i, 500) for i in range(9)]
    step = plan_compaction(big + mid + small, max_small=8, target_rows=1 << 20)
    assert step is not None and step.target_rows == 2048
    assert set(step.excluded) == {f.id for f in big + mid}
    mids = [FragmentStats(200 + i, 20_000) for i in range(9)]
    step = plan_compaction(big + mids, max_small=8, target_rows=1 << 20)
    assert step is not None and step.target_rows == 131072
    with_deletes = [
        FragmentStats(1, 1 << 20, deleted=10),
        *[FragmentStats(i, 1 << 20) for i in range(2, 12)],
    ]
    step = plan_compaction(with_deletes, max_small=0, target_rows=1 << 20)
    assert step is not None and 1 not in step.excluded


def test_version_keeper_keeps_only_what_readers_of_older_versions_need() -> None:
    # Opened at version 5 (versions 2..4 exist): those are kept 10 s, their history unknown.
    keeper = VersionKeeper(10.0, lowest=2, latest=5, now=100.0)
    assert keeper.doomed(latest=9, now=101.0) == [5, 6, 7, 8]  # appends only: all can go
    keeper.cleaned()
    keeper.rewrote(9, now=102.0)  # a compaction step started from version 9
    keeper.rewrote(11, now=103.0)  # and a trim from version 11
    assert keeper.doomed(latest=14, now=104.0) == [10, 12, 13]
    # A cleanup that failed changes nothing: the same versions are named again.
    assert keeper.doomed(latest=14, now=104.0) == [10, 12, 13]
    keeper.cleaned()
    assert keeper.doomed(latest=15, now=110.5) == [2, 3, 4, 10, 12, 13, 14]  # history expired
    keeper.cleaned()
    assert keeper.doomed(latest=16, now=112.5) == [9, 10, 12, 13, 14, 15]  # 9's time is up
    keeper.cleaned()
    assert keeper.doomed(latest=17, now=120.0) == [11, 12, 13, 14, 15, 16]  # and 11's
    keeper.cleaned()
    assert keeper.doomed(latest=18, now=121.0) == [17]


def test_consumer_positions_are_durable_per_consumer_files(tmp_path: Path) -> None:
    positions = ConsumerPositions(tmp_path)
    assert positions.all() == {} and positions.get("a") is None
    positions.commit("evictor/1", 5)
    positions.commit("prewarm", 9)
    positions.commit("evictor/1", 7)
    assert ConsumerPositions(tmp_path).all() == {"evictor/1": 7, "prewarm": 9}
    assert not [p for p in (tmp_path / "consumers").iterdir() if p.name.startswith(".")]
    assert positions.remove("prewarm") and not positions.remove("prewarm")
    with pytest.raises(InvalidValueError):
        positions.commit("a", -1)
    with pytest.raises(InvalidNameError):
        positions.commit("", 1)
