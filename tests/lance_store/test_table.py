"""LanceTable: the dataset operations queue and KV share, on real Lance datasets."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from persisting.errors import InvalidNameError, SchemaMismatchError
from persisting.kv.disk.range_reads import read_file_range
from persisting.lance_store import LanceTable, StorageRoot, blob_field, durable
from persisting.lance_store.blobs import blob_references, blob_values

SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("name", pa.string())])


def rows(start: int, n: int) -> list[dict]:
    return [{"id": i, "name": f"n{i}"} for i in range(start, start + n)]


def test_create_append_take_scan_delete(root: Path) -> None:
    store = StorageRoot(root)
    t = store.open_table(store.queue_path("topic/a", 0), SCHEMA)
    assert t.count_rows() == 0
    v1 = t.append(rows(0, 10))
    v2 = t.append(pa.Table.from_pylist(rows(10, 5), schema=SCHEMA))
    assert v2 == v1 + 1
    assert t.count_rows() == 15
    assert t.num_fragments() == 2
    assert t.take([0, 14], columns=["name"]).column("name").to_pylist() == ["n0", "n14"]
    assert t.scan(["id"], filter="id >= 12").column("id").to_pylist() == [12, 13, 14]
    t.delete("id < 3")
    assert t.count_rows() == 12
    # A second handle sees the same data, the first sees later commits after refresh.
    other = store.open_table(store.queue_path("topic/a", 0), SCHEMA)
    other.append(rows(100, 1))
    assert t.refresh() is True
    assert t.count_rows() == 13


def test_append_adds_a_fragment_without_rewriting_old_files(root: Path) -> None:
    t = StorageRoot(root).open_table(root / "kv" / "m" / "meta.lance", SCHEMA)
    t.append(rows(0, 100))
    data_dir = t.path / "data"
    before = {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()}
    t.append(rows(100, 100))
    after = {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()}
    assert all(after[name] == mtime for name, mtime in before.items())
    assert len(after) == len(before) + 1


def test_schema_mismatch_is_a_clear_error(root: Path) -> None:
    path = root / "d.lance"
    LanceTable(path, SCHEMA).append(rows(0, 3))
    with pytest.raises(SchemaMismatchError, match="name"):
        LanceTable(path, pa.schema([pa.field("id", pa.int64()), pa.field("name", pa.int32())]))
    with pytest.raises(SchemaMismatchError):
        LanceTable(path, SCHEMA.append(pa.field("strict", pa.int64(), nullable=False)))
    t = LanceTable(path, SCHEMA)
    with pytest.raises(SchemaMismatchError):
        t.append([{"id": "not-an-int", "name": "x"}])
    assert t.count_rows() == 3


def test_additive_schema_evolution(root: Path) -> None:
    path = root / "d.lance"
    LanceTable(path, SCHEMA).append(rows(0, 3))
    wider = SCHEMA.append(pa.field("score", pa.float64()))
    t = LanceTable(path, wider)
    assert t.schema.names == ["id", "name", "score"]
    t.append([{"id": 9, "name": "n9", "score": 0.5}])
    got = t.scan(["id", "score"]).to_pylist()
    assert got[:3] == [{"id": i, "score": None} for i in range(3)]
    assert got[3] == {"id": 9, "score": 0.5}
    t.evolve([pa.field("flag", pa.bool_())])
    assert "flag" in LanceTable(path, SCHEMA).schema.names


def test_compact_and_cleanup_bound_fragments_and_versions(root: Path) -> None:
    t = LanceTable(root / "d.lance", SCHEMA)
    for i in range(12):
        t.append(rows(i * 10, 10))
    t.delete("id % 2 = 0")
    size_before = t.size_bytes()
    t.compact()
    assert t.num_fragments() == 1
    assert t.count_rows() == 60
    removed = t.cleanup()
    assert removed > 0
    assert t.num_versions() == 1
    assert t.size_bytes() < size_before
    assert sorted(t.scan(["id"]).column("id").to_pylist()) == list(range(1, 120, 2))


def test_durable_commit_fsyncs_new_files_and_directories(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = LanceTable(root / "d.lance", SCHEMA)
    t.append(rows(0, 5), durable=True)
    synced: list[str] = []
    real = durable.fsync_fd

    def tracing(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(durable, "fsync_fd", tracing)
    before = {p for p in (t.path / "data").iterdir()}
    t.append(rows(5, 5), durable=True)
    new_data = [p for p in (t.path / "data").iterdir() if p not in before]
    assert len(new_data) == 1
    manifests = sorted((t.path / "_versions").glob("*.manifest"))
    newest_manifest = min(manifests, key=lambda p: int(p.stem))  # v2 names count down
    assert str(new_data[0]) in synced
    assert str(newest_manifest) in synced
    assert str(t.path / "data") in synced
    assert str(t.path / "_versions") in synced
    assert str(t.path) in synced
    # Files already synced are not fsynced again: the cost stays per-commit.
    synced.clear()
    t.append(rows(10, 1), durable=True)
    old = [s for s in synced if Path(s) in before]
    assert old == []
    # A non-durable append does not fsync at all.
    synced.clear()
    t.append(rows(20, 1))
    assert synced == []


def test_blob_columns_inline_and_external_references(root: Path, tmp_path: Path) -> None:
    schema = pa.schema([pa.field("key", pa.string()), blob_field("payload")])
    t = LanceTable(root / "b.lance", schema)
    payload = os.urandom(1 << 20)
    t.append(pa.table({"key": ["inline"], "payload": blob_values([payload])}, schema=schema))
    ext = tmp_path / "ext.bin"
    ext.write_bytes(b"H" * 4096 + payload + b"T" * 10)
    refs = blob_references([ext], [4096], [len(payload)])
    t.append(pa.table({"key": ["ref"], "payload": refs}, schema=schema))
    assert t.read_blobs("payload", [0, 1]) == [payload, payload]
    desc = t.scan(["key", "payload"]).column("payload").to_pylist()
    assert desc[1]["position"] == 4096 and desc[1]["size"] == len(payload)
    assert desc[1]["blob_uri"] == ext.as_uri()
    out = bytearray(len(payload))
    read_file_range(ext, 4096, memoryview(out))
    assert bytes(out) == payload


def test_open_table_refuses_paths_outside_the_root(tmp_path: Path) -> None:
    with pytest.raises(InvalidNameError):
        StorageRoot(tmp_path / "root").open_table(tmp_path / "elsewhere.lance", SCHEMA)


def _append_worker(path: str, worker: int, commits: int, barrier) -> None:
    t = LanceTable(path, SCHEMA)
    barrier.wait()
    for i in range(commits):
        t.append([{"id": worker * 1_000_000 + i, "name": f"w{worker}"}])


def test_two_processes_appending_concurrently_lose_no_rows(root: Path) -> None:
    path = str(root / "shared.lance")
    LanceTable(path, SCHEMA)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    commits = 40
    procs = [ctx.Process(target=_append_worker, args=(path, w, commits, barrier)) for w in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ids = lance.dataset(path).to_table(columns=["id"]).column("id").to_pylist()
    assert len(ids) == 2 * commits
    assert sorted(ids) == sorted(w * 1_000_000 + i for w in (1, 2) for i in range(commits))
