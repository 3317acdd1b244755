"""StorageRoot's read-side helpers for tools: bucket listing and opening without creating."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from persisting.lance_store import StorageRoot

SCHEMA = pa.schema([pa.field("id", pa.int64())])


def test_list_buckets_lists_only_the_buckets_the_layout_makes(root: Path) -> None:
    store = StorageRoot(root)
    assert store.list_buckets("events/a") == []  # no topic yet
    for bucket in (10, 2, 0):
        store.queue_bucket_dir("events/a", bucket).mkdir(parents=True)
    for stray in ("bucket_01", "bucket_x", "bucket_", "other", "bucket_\u00b2"):
        (store.topic_dir("events/a") / stray).mkdir()
    assert store.list_buckets("events/a") == [0, 2, 10]
    assert store.list_buckets("events_a") == []  # a different topic, not a prefix match


def test_existing_table_never_creates_and_keeps_the_schema(root: Path) -> None:
    store = StorageRoot(root)
    path = store.queue_path("t", 0)
    assert store.existing_table(path) is None
    assert not path.exists()
    table = store.open_table(path, SCHEMA)
    table.append([{"id": 1}, {"id": 2}])
    seen = store.existing_table(path)
    assert seen is not None
    assert seen.count_rows() == 2
    assert seen.schema.names == ["id"]
    assert seen.num_versions() == table.num_versions()
