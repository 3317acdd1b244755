"""`persisting compact` on real KV metadata tables and queue buckets: fewer fragments and
versions, fewer bytes, and every chunk and record still there afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

from persisting.cli import app
from tests.cli.cli_ops_helpers import (
    MODEL,
    fill,
    key,
    open_store,
    read_queue,
    same,
    value,
    write_queue,
)

runner = CliRunner()
OTHER = "org/small-model"


def invoke(*args: object) -> Result:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "160"})


def compact_json(root: Path, *args: object) -> dict[str, Any]:
    result = invoke("compact", "--storage-path", root, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def by_name(data: dict[str, Any]) -> dict[tuple[str, str, int | None], dict[str, Any]]:
    return {(d["kind"], d["name"], d["bucket"]): d for d in data["datasets"]}


def test_compact_everything_then_read_everything_back(root: Path) -> None:
    fill(root, MODEL, 10, batches=5)
    write_queue(root, "kv-events", 0, 40, flushes=4, consumers={"prewarm": 10})
    records = read_queue(root, "kv-events", 0)
    data = compact_json(root, "--older-than", "0")
    sets = by_name(data)
    assert set(sets) == {("kv", MODEL, None), ("queue", "kv-events", 0)}
    kv, queue = sets[("kv", MODEL, None)], sets[("queue", "kv-events", 0)]
    assert (kv["fragments_before"], kv["fragments_after"]) == (5, 1)
    assert (queue["fragments_before"], queue["fragments_after"]) == (4, 1)
    for d in (kv, queue):
        assert d["error"] is None
        assert d["versions_before"] > 1 and d["versions_after"] == 1
        assert d["bytes_after"] < d["bytes_before"] and d["removed_bytes"] > 0
    assert data["bytes_after"] == kv["bytes_after"] + queue["bytes_after"]
    # the metadata still points at every payload, the queue keeps its offsets and order
    with open_store(root) as store:
        assert store.stats()["corruptions"] == 0 and store.stats()["recovered_files"] == 0
        assert all(same(store.get(key(i)), value(i)) for i in range(10))
    assert read_queue(root, "kv-events", 0) == records == [(i, i) for i in range(40)]
    inspected = json.loads(invoke("inspect", "--storage-path", root, "--json").stdout)
    assert inspected["topics"][0]["buckets"][0]["consumers"][0]["lag"] == 30
    assert inspected["models"][0]["note"] is None


def test_recent_versions_are_kept_by_default_for_readers_still_on_them(root: Path) -> None:
    fill(root, MODEL, 4, batches=4)
    (kv,) = compact_json(root)["datasets"]
    assert (kv["fragments_before"], kv["fragments_after"]) == (4, 1)
    assert kv["versions_after"] > kv["versions_before"]  # none is 10 s old: all kept
    assert kv["removed_bytes"] == 0
    (again,) = compact_json(root, "--older-than", "0")["datasets"]
    assert again["versions_after"] == 1 and again["removed_bytes"] > 0


def test_compact_selected_models_and_topics_only(root: Path) -> None:
    fill(root, MODEL, 2, batches=2)
    fill(root, OTHER, 2, batches=2)
    write_queue(root, "kv-events", 0, 4, flushes=2)
    write_queue(root, "kv-events", 3, 4, flushes=2)
    write_queue(root, "audit", 0, 4, flushes=2)
    assert set(by_name(compact_json(root, OTHER))) == {("kv", OTHER, None)}
    assert set(by_name(compact_json(root, "--topic", "kv-events"))) == {
        ("queue", "kv-events", 0),
        ("queue", "kv-events", 3),
    }
    assert set(by_name(compact_json(root, MODEL, "--topic", "audit"))) == {
        ("kv", MODEL, None),
        ("queue", "audit", 0),
    }
    table = invoke("compact", "--storage-path", root, OTHER, "--older-than", "0")
    assert table.exit_code == 0, table.output
    assert f"kv {OTHER}" in table.stdout and "1 dataset(s)" in table.stdout


def test_unknown_names_are_clear_errors(root: Path) -> None:
    fill(root, MODEL, 1)
    result = invoke("compact", "--storage-path", root, "no/such-model")
    assert result.exit_code == 2
    assert "no model 'no/such-model'" in result.stderr and MODEL in result.stderr
    result = invoke("compact", "--storage-path", root, "--topic", "nope")
    assert result.exit_code == 2 and "no topic 'nope'" in result.stderr
    result = invoke("compact", "--storage-path", root, "--older-than", "-1")
    assert result.exit_code == 2
    empty = root.parent / "empty"
    empty.mkdir()
    result = invoke("compact", "--storage-path", empty)
    assert result.exit_code == 0 and "Nothing to compact" in result.stdout


def test_compacting_under_a_live_store_loses_nothing(root: Path) -> None:
    fill(root, MODEL, 6, batches=6)
    with open_store(root) as live:  # a server's store stays open across the compaction
        (kv,) = compact_json(root, "--older-than", "0")["datasets"]
        assert kv["error"] is None and kv["fragments_after"] == 1
        live.batched_put([key(i) for i in range(6, 9)], [value(i) for i in range(6, 9)])
        live.flush()  # its next metadata commit lands on the compacted table
        assert all(same(live.get(key(i)), value(i)) for i in range(9))
    with open_store(root) as reopened:
        stats = reopened.stats()
        assert stats["disk_items"] == 9 and stats["recovered_files"] == 0
        assert all(same(reopened.get(key(i)), value(i)) for i in range(9))
