"""LanceTable additions the queue relies on: nested widening, config, selective compaction."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from persisting.lance_store import LanceTable

BASE = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("s", pa.struct([pa.field("a", pa.int64())])),
        pa.field("ls", pa.list_(pa.struct([pa.field("a", pa.int64())]))),
    ]
)


def test_add_fields_merges_new_children_into_existing_structs(tmp_path: Path) -> None:
    t = LanceTable(tmp_path / "d.lance", BASE)
    t.append([{"id": 1, "s": {"a": 1}, "ls": [{"a": 1}]}])
    t.add_fields(
        [
            pa.field("s", pa.struct([pa.field("b", pa.string(), metadata={"k": "v"})])),
            pa.field("ls", pa.list_(pa.struct([pa.field("c", pa.bool_())]))),
            pa.field("new", pa.float64()),
        ]
    )
    s_type = t.schema.field("s").type
    assert [f.name for f in s_type] == ["a", "b"]
    assert s_type.field("b").metadata == {b"k": b"v"}
    assert [f.name for f in t.schema.field("ls").type.value_type] == ["a", "c"]
    t.append([{"id": 2, "s": {"a": 2, "b": "x"}, "ls": [{"a": 2, "c": True}], "new": 0.5}])
    got = t.scan(["id", "s", "ls", "new"]).to_pylist()
    assert got[0] == {"id": 1, "s": {"a": 1, "b": None}, "ls": [{"a": 1, "c": None}], "new": None}
    assert got[1] == {"id": 2, "s": {"a": 2, "b": "x"}, "ls": [{"a": 2, "c": True}], "new": 0.5}
    assert t.count_rows("s.b = 'x'") == 1


def test_config_is_versioned_with_the_data_and_survives_appends(tmp_path: Path) -> None:
    path = tmp_path / "d.lance"
    t = LanceTable(path, BASE)
    t.set_config({"watermark": "7"}, durable=True)
    t.append([{"id": 1}])
    t.compact()
    assert LanceTable(path, BASE).config()["watermark"] == "7"


def test_compact_passes_options_and_leaves_excluded_fragments(tmp_path: Path) -> None:
    t = LanceTable(tmp_path / "d.lance", BASE)
    for i in range(6):
        t.append([{"id": i}])
    first = t.dataset.get_fragments()[0].fragment_id
    t.compact(excluded_fragment_ids=[first])
    ids = [f.fragment_id for f in t.dataset.get_fragments()]
    assert ids[0] == first and len(ids) == 2
    assert t.scan(["id"]).column("id").to_pylist() == list(range(6))


def test_maintenance_does_not_disturb_readers_in_other_threads(tmp_path: Path) -> None:
    import threading

    t = LanceTable(tmp_path / "d.lance", BASE)
    for i in range(40):
        t.append([{"id": i}])
    stop = threading.Event()
    failures: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            try:
                assert t.dataset.count_rows() >= 20
                t.dataset.to_table(columns=["id"], limit=5)
            except BaseException as exc:  # a panic surfaces as PanicException (BaseException)
                failures.append(exc)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3):
            t.compact()
            t.set_config({"k": "v"})
            t.delete("id < 5")
            t.add_fields([pa.field(f"c{len(t.schema)}", pa.int64())])
            t.cleanup()
    finally:
        stop.set()
        reader.join()
    assert failures == []
    assert t.count_rows() == 35


def test_overwrite_replaces_the_rows_and_keeps_schema_metadata_and_config(tmp_path: Path) -> None:
    marked = BASE.append(pa.field("t", pa.int64(), metadata={"k": "v"}))
    t = LanceTable(tmp_path / "d.lance", marked)
    t.append([{"id": i} for i in (3, 1, 2)])
    t.set_config({"watermark": "1"})
    t.overwrite(t.dataset.to_table().sort_by("id"), durable=True)
    again = LanceTable(tmp_path / "d.lance", marked)
    assert again.scan(["id"]).column("id").to_pylist() == [1, 2, 3]
    assert again.config()["watermark"] == "1"
    assert again.schema.field("t").metadata == {b"k": b"v"}
