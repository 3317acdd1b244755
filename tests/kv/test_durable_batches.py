"""What a durable (``sync``) batch syncs: every payload file, each destination directory
once, and ``payload/`` when the batch created a ``payload/<hh>`` directory; and the files
of one batch are written and synced on several threads at once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from persisting.kv import open_kv_store
from persisting.lance_store import durable
from tests.kv.kv_helpers import MODEL, in_flight, key, tensor

MiB = 1 << 20


def trace_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(path, thread name) of every fsync the payload files make from now on."""
    synced: list[tuple[str, str]] = []
    real = durable.fsync_fd
    lock = threading.Lock()

    def tracing(fd: int) -> None:
        with lock:
            synced.append((os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread().name))
        real(fd)

    monkeypatch.setattr("persisting.kv.disk.payload_files.fsync_fd", tracing)
    monkeypatch.setattr(durable, "fsync_fd", tracing)
    return synced


def test_a_batch_that_creates_a_payload_subdirectory_syncs_payload_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_kv_store(tmp_path, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        synced = trace_fsyncs(monkeypatch)
        store.put(key(1), tensor(1))
        payload = store.directory / "payload"
        (subdir,) = [p for p in payload.iterdir()]
        paths = [p for p, _t in synced]
        assert str(subdir) in paths  # the rename into it
        assert str(payload) in paths  # the new directory's own entry
        # A second put into the same subdirectory need not sync payload/ again.
        second = next(i for i in range(2, 5000) if _subdir_of(store, i) == subdir.name)
        synced.clear()
        store.put(key(second), tensor(second))
        paths = [p for p, _t in synced]
        assert str(subdir) in paths and str(payload) not in paths


def _subdir_of(store, i: int) -> str:  # type: ignore[no-untyped-def]
    from persisting.kv.keys import key_hash

    return f"{key_hash(str(key(i))) >> 56:02x}"


def test_the_files_of_a_durable_batch_are_synced_on_several_threads_each_dir_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 16
    with open_kv_store(tmp_path, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        synced = trace_fsyncs(monkeypatch)
        store.batched_put([key(i) for i in range(n)], [tensor(i) for i in range(n)])
        payload = str(store.directory / "payload") + "/"
        tmp_syncs = [(p, t) for p, t in synced if p.startswith(payload) and p.endswith(".tmp")]
        assert len(tmp_syncs) == n  # each file before its rename (beside its final place)
        assert len({t for _p, t in tmp_syncs}) > 1  # on several writer threads
        assert all(t.startswith("persisting-kv-write") for _p, t in tmp_syncs)
        dir_syncs = [p for p, _t in synced if os.path.isdir(p)]
        assert len(dir_syncs) == len(set(dir_syncs))  # no directory twice
    with open_kv_store(tmp_path, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as reopened:
        assert all(reopened.contains(key(i)) for i in range(n))


def test_a_failed_write_in_a_parallel_batch_stores_nothing_and_leaves_no_tmp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One file's sync fails (EIO, as a failing disk reports it): the batch raises a typed
    error, no file of it is published, its reservation and tmp files are gone."""
    from persisting.errors import StorageIOError

    calls = {"n": 0}
    real = durable.fsync_fd
    lock = threading.Lock()

    def failing(fd: int) -> None:
        with lock:
            calls["n"] += 1
            nth = calls["n"]
        if nth == 3:
            raise OSError(5, "Input/output error")
        real(fd)

    with open_kv_store(tmp_path, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        used = store.stats()["disk_bytes"]
        monkeypatch.setattr("persisting.kv.disk.payload_files.fsync_fd", failing)
        with pytest.raises(StorageIOError, match="writing"):
            store.batched_put([key(i) for i in range(8)], [tensor(i) for i in range(8)])
        monkeypatch.undo()
        assert not any(store.contains(key(i)) for i in range(8))
        assert in_flight(store.directory) == []
        assert store.stats()["disk_bytes"] <= used + 64 * 1024  # metadata only, no payload
        store.batched_put([key(i) for i in range(8)], [tensor(i) for i in range(8)])
        assert all(store.contains(key(i)) for i in range(8))
