"""`persisting inspect` and `persisting drop` on real storage roots (KV stores and queues)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from persisting.cli import app
from persisting.lance_store import StorageRoot
from tests.cli.cli_ops_helpers import (
    FILE_BYTES,
    MODEL,
    fill,
    key,
    open_store,
    same,
    value,
    write_queue,
)

runner = CliRunner()
OTHER = "org/small-model"


def invoke(*args: object, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "160", **(env or {})})


def files_bytes(path: Path) -> int:
    """What du counts for the files under ``path`` (allocated blocks)."""
    return sum(
        os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _s, fs in os.walk(path) for f in fs
    )


def test_inspect_lists_models_chunks_metadata_and_queue_topics(root: Path) -> None:
    fill(root, MODEL, 6, batches=3)  # three metadata commits
    fill(root, OTHER, 2)
    write_queue(root, "kv-events", 0, 10, flushes=2, consumers={"prewarm": 4})
    write_queue(root, "kv-events", 1, 3)
    result = invoke("inspect", "--storage-path", root, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["root"] == str(root) and data["bytes"] == files_bytes(root)
    models = {m["model"]: m for m in data["models"]}
    assert set(models) == {MODEL, OTHER}
    big = models[MODEL]
    assert (big["chunks"], big["meta_rows"]) == (6, 6)
    assert big["meta_fragments"] == 3 and big["meta_versions"] == 4  # created + 3 appends
    assert big["bytes"] == files_bytes(StorageRoot(root).kv_path(MODEL)) >= 6 * FILE_BYTES
    assert big["note"] is None
    assert (models[OTHER]["chunks"], models[OTHER]["meta_fragments"]) == (2, 1)
    (topic,) = data["topics"]
    assert (topic["topic"], topic["rows"]) == ("kv-events", 13)
    first, second = topic["buckets"]
    assert (first["bucket"], first["rows"], first["fragments"]) == (0, 10, 2)
    assert (first["first_offset"], first["end_offset"]) == (0, 10)
    assert [(c["consumer"], c["position"], c["lag"]) for c in first["consumers"]] == [
        ("prewarm", 4, 6)
    ]
    assert (second["bucket"], second["rows"], second["consumers"]) == (1, 3, [])

    table = invoke("inspect", "--storage-path", root)
    assert table.exit_code == 0, table.output
    for text in (MODEL, OTHER, "kv-events", "meta rows", "0..10", "prewarm", "lag"):
        assert text in table.stdout


def test_inspect_counts_payload_files_and_flags_metadata_behind_them(root: Path) -> None:
    fill(root, MODEL, 4)
    with open_store(root) as store:
        lost = store.lease(key(0), 30)
        assert lost is not None
    os.unlink(lost.path)  # a payload file gone behind the metadata's back
    data = json.loads(invoke("inspect", "--storage-path", root, "--json").stdout)
    (model,) = data["models"]
    assert (model["chunks"], model["meta_rows"]) == (3, 4)
    assert "reconciles" in model["note"]
    with open_store(root) as store:  # an open reconciles the index with the files
        assert not store.contains(key(0)) and same(store.get(key(1)), value(1))
        store.flush()
    (model,) = json.loads(invoke("inspect", "--storage-path", root, "--json").stdout)["models"]
    assert (model["chunks"], model["meta_rows"], model["note"]) == (3, 3, None)


def test_inspect_survives_a_damaged_metadata_table(root: Path) -> None:
    fill(root, MODEL, 3)
    versions = StorageRoot(root).kv_path(MODEL) / "meta.lance" / "_versions"
    for manifest in versions.iterdir():
        manifest.write_bytes(b"not a manifest")
    result = invoke("inspect", "--storage-path", root, "--json")
    assert result.exit_code == 0, result.output
    (model,) = json.loads(result.stdout)["models"]
    assert model["chunks"] == 3 and model["meta_rows"] is None
    assert "unreadable" in model["note"] and "rebuilds" in model["note"]
    table = invoke("inspect", "--storage-path", root)
    assert "Note:" in table.stdout and "unreadable" in table.stdout


def test_inspect_uses_the_settings_root_and_rejects_a_missing_one(root: Path) -> None:
    fill(root, MODEL, 1)
    result = invoke("inspect", "--json", env={"PERSISTING_STORAGE_PATH": str(root)})
    assert result.exit_code == 0, result.output
    assert [m["model"] for m in json.loads(result.stdout)["models"]] == [MODEL]
    missing = invoke("inspect", "--storage-path", root / "nowhere")
    assert missing.exit_code == 2
    assert "no storage root" in missing.stderr and "Traceback" not in missing.output
    empty = root / "empty"
    empty.mkdir()
    data = json.loads(invoke("inspect", "--storage-path", empty, "--json").stdout)
    assert (data["models"], data["topics"]) == ([], [])


def test_drop_needs_yes_off_a_terminal_then_removes_only_that_model(root: Path) -> None:
    fill(root, MODEL, 5)
    fill(root, OTHER, 2)
    refused = invoke("drop", MODEL, "--storage-path", root)
    assert refused.exit_code == 2
    assert "without --yes" in refused.stderr and "5 chunk(s)" in refused.stderr
    assert StorageRoot(root).kv_path(MODEL).is_dir()
    before = files_bytes(StorageRoot(root).kv_path(MODEL))
    result = invoke("drop", MODEL, "--yes", "--storage-path", root, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["model"], data["dropped"], data["chunks"], data["bytes"]) == (
        MODEL,
        True,
        5,
        before,
    )
    assert StorageRoot(root).list_models() == [OTHER]
    with open_store(root, OTHER) as store:  # the other namespace is untouched
        assert same(store.get(key(1, OTHER)), value(1))
    again = invoke("drop", MODEL, "--yes", "--storage-path", root)
    assert again.exit_code == 1
    assert "no model" in again.stderr and OTHER in again.stderr


def test_drop_rejects_unsafe_names_and_never_leaves_the_root(root: Path) -> None:
    fill(root, MODEL, 1)
    outside = root.parent / "victim"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    for name, message in (
        ("", "must not be empty"),
        ("bad\x00name", "control characters"),
        ("x" * 300, "limit"),
    ):
        result = invoke("drop", name, "--yes", "--storage-path", root)
        assert result.exit_code == 2, (name, result.output)
        assert message in result.stderr and "Traceback" not in result.output
    for name in ("../victim", "../../victim", "/tmp", "."):
        result = invoke("drop", name, "--yes", "--storage-path", root)
        assert result.exit_code == 1 and "no model" in result.stderr
    assert (outside / "keep.txt").read_text() == "precious"
    assert StorageRoot(root).list_models() == [MODEL]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_drop_asks_on_a_terminal(root: Path) -> None:
    fill(root, MODEL, 2)
    for answer, code in ((b"n\n", 1), (b"y\n", 0)):
        controller, terminal = pty.openpty()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "persisting.cli", "drop", MODEL, "--storage-path", root],
                stdin=terminal,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            os.write(controller, answer)
            out, err = proc.communicate(timeout=60)
        finally:
            os.close(controller)
            os.close(terminal)
        assert proc.returncode == code, err
        assert b"Drop model" in err and b"2 chunk(s)" in err
        if code:
            assert b"nothing dropped" in err and StorageRoot(root).list_models() == [MODEL]
        else:
            assert b"Dropped" in out and StorageRoot(root).list_models() == []
