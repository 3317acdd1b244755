"""Across OS processes: SIGKILL before any flush loses no acknowledged put; Pulsing producer
and consumer in separate processes; readers elsewhere see flushes and resume from commits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lance
import pytest

from persisting.errors import StorageIOError
from persisting.lance_store import StorageRoot
from persisting.queue import LanceBackend, open_bucket
from persisting.queue.backend import WAL_DIR
from tests.queue.queue_helpers import free_port
from tests.queue.queue_procs import record, summary
from tests.timing import HANG_S, wait_until

PROCS = Path(__file__).with_name("queue_procs.py")
REPO = Path(__file__).resolve().parents[2]


def start(role: str, **args: Any) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{PROCS.parent}")
    return subprocess.Popen(
        [sys.executable, str(PROCS), role, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def acked(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [int(line) for line in path.read_text().splitlines()]


def progress(predicate, proc: subprocess.Popen, what: str, timeout: float = HANG_S) -> None:
    """Wait until ``predicate()`` holds, as ``proc`` works towards it: an AssertionError
    with its stderr if it exits first, or makes no progress (a hang: then it is killed)."""
    try:
        wait_until(lambda: predicate() or proc.poll() is not None, what, timeout)
    except AssertionError:
        proc.kill()
        raise AssertionError(f"child made no progress: {proc.communicate()[1][-3000:]}") from None
    if not predicate():
        raise AssertionError(f"child exited early: {proc.communicate()[1][-3000:]}")


def output_of(proc: subprocess.Popen, timeout: float = 90) -> Any:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def sigkill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()  # reaps it and closes its pipes
    assert proc.returncode == -signal.SIGKILL


def expected(seqs: list[int]) -> list[list[Any]]:
    return [summary(record(s)) for s in seqs]


@pytest.mark.timeout(120)
def test_sigkill_of_a_writer_before_any_flush_loses_no_acknowledged_put(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket_0"
    acks = tmp_path / "acks"
    proc = start("writer", bucket_dir=str(bucket), acks=str(acks))
    progress(lambda: len(acked(acks)) >= 400, proc, "400 acknowledged puts")
    with pytest.raises(StorageIOError, match="another process"):
        LanceBackend(bucket_id=0, storage_path=bucket, lock_timeout_s=0.2)
    sigkill(proc)  # mid-stream: it was still putting

    confirmed = acked(acks)
    assert confirmed == list(range(len(confirmed)))
    assert lance.dataset(str(bucket / "data.lance")).count_rows() == 0  # nothing was flushed
    assert sum(p.stat().st_size for p in (bucket / WAL_DIR).glob("*.wal")) > 0

    backend = LanceBackend(bucket_id=0, storage_path=bucket)  # the kernel freed the lock
    try:
        stored = asyncio.run(backend.get(backend.total_count(), 0))
        assert len(stored) >= len(confirmed)  # puts written but not yet acked may be there too
        assert [summary(r) for r in stored[: len(confirmed)]] == expected(confirmed)
        assert lance.dataset(str(backend.path)).count_rows() == len(stored)  # replayed + flushed
        assert asyncio.run(backend.stats())["wal_bytes"] < 64
    finally:
        backend.close()


@pytest.mark.timeout(180)
def test_sigkill_of_the_process_hosting_a_pulsing_bucket_loses_no_acknowledged_put(
    tmp_path: Path,
) -> None:
    root, topic = tmp_path / "root", "prefill/events"
    acks = tmp_path / "acks"
    proc = start("pulsing_writer", root=str(root), topic=topic, acks=str(acks))
    progress(lambda: len(acked(acks)) >= 150, proc, "150 acknowledged puts", 90)
    sigkill(proc)

    confirmed = acked(acks)
    dataset = StorageRoot(root).queue_path(topic, 0)
    assert dataset.is_dir()  # <root>/queue/<encoded topic>/bucket_0/data.lance
    assert lance.dataset(str(dataset)).count_rows() == 0  # killed before any flush
    reader = start("pulsing_reader", root=str(root), topic=topic, count=len(confirmed))
    got = output_of(reader)
    assert got[: len(confirmed)] == expected(confirmed)
    assert lance.dataset(str(dataset)).count_rows() == len(got)


@pytest.mark.timeout(120)
def test_flush_durability_takes_over_the_log_of_a_killed_wal_writer(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket_0"
    acks = tmp_path / "acks"
    proc = start("writer", bucket_dir=str(bucket), acks=str(acks))
    progress(lambda: len(acked(acks)) >= 50, proc, "50 acknowledged puts")
    sigkill(proc)
    confirmed = acked(acks)
    backend = LanceBackend(bucket_id=0, storage_path=bucket, durability="flush")
    try:
        stored = asyncio.run(backend.get(10**6, 0))
        assert [summary(r) for r in stored[: len(confirmed)]] == expected(confirmed)
        assert not list((bucket / WAL_DIR).glob("*.wal"))  # "flush" keeps no log
        asyncio.run(backend.put(record(10**6)))
        assert asyncio.run(backend.stats())["wal_bytes"] == 0
    finally:
        backend.close()


@pytest.mark.timeout(180)
def test_pulsing_producer_and_consumer_in_separate_processes(tmp_path: Path) -> None:
    root, topic, count = tmp_path / "root", "kv-events", 60
    files = {name: str(tmp_path / name) for name in ("ready", "joined", "done")}
    seed_port = free_port()
    producer = start(
        "pulsing_producer", root=str(root), topic=topic, port=seed_port, count=count, **files
    )
    try:
        progress(Path(files["ready"]).exists, producer, "the producer ready", 90)
        consumer = start(
            "pulsing_consumer",
            root=str(root),
            topic=topic,
            port=free_port(),
            seed_port=seed_port,
            count=count,
            joined=files["joined"],
        )
        got = output_of(consumer, timeout=150)
        Path(files["done"]).write_text("done")
        producer.communicate(timeout=60)
    finally:
        if producer.poll() is None:
            producer.kill()
        producer.communicate()
    assert sorted(got, key=lambda item: item[1]) == expected(list(range(count)))  # each once
    store = StorageRoot(root)
    for bucket in (0, 1):  # each bucket is its own dataset, in put order
        seqs = lance.dataset(str(store.queue_path(topic, bucket))).to_table()["seq"].to_pylist()
        assert seqs == sorted(seqs)
        assert [s for s in (item[1] for item in got) if s in set(seqs)] == seqs


@pytest.mark.timeout(120)
def test_a_consumer_elsewhere_sees_flushes_and_resumes_from_its_commit(tmp_path: Path) -> None:
    root, topic = tmp_path / "root", "kv-events"
    ready = tmp_path / "ready"
    first = start(
        "direct_consumer", root=str(root), topic=topic, name="evictor", count=30, ready=str(ready)
    )
    progress(ready.exists, first, "the consumer ready")  # the reader exists before any flush
    writer = open_bucket(root, topic, 0, flush_interval_s=0, batch_size=10**6)
    try:
        for part in range(3):
            asyncio.run(writer.put_batch([record(i) for i in range(part * 10, part * 10 + 10)]))
            asyncio.run(writer.flush())
        got = output_of(first)
        assert [offset for offset, _ in got] == list(range(30))
        assert [s for _, s in got] == expected(list(range(30)))
        assert writer.positions.get("evictor") == 30

        asyncio.run(writer.put_batch([record(i) for i in range(30, 40)]))
        asyncio.run(writer.flush())
        ready.unlink()
        second = start(
            "direct_consumer",
            root=str(root),
            topic=topic,
            name="evictor",
            count=10,
            ready=str(ready),
        )
        resumed = output_of(second)
        assert [offset for offset, _ in resumed] == list(range(30, 40))
        assert writer.positions.all() == {"evictor": 40}
    finally:
        writer.close()
