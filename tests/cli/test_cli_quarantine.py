"""`persisting quarantine`: what a namespace set aside, bringing it back, deleting it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from typer.testing import CliRunner, Result

from persisting.cli import app
from persisting.lance_store import StorageRoot
from tests.cli.cli_ops_helpers import MODEL, fill, key, open_store, same, value

runner = CliRunner()
COUNT = 6


def invoke(*args: object) -> Result:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "160"})


def copy_without_key(src: Path, dst: Path) -> Path:
    """``cp -a src/kv/* dst/kv/`` (the key files stay behind), then lose the copy's metadata:
    the next open quarantines every file."""
    namespace = StorageRoot(src).kv_path(MODEL)
    (dst / "kv").mkdir(parents=True, mode=0o700)
    dst.chmod(0o700)
    subprocess.run(["cp", "-a", str(namespace), str(dst / "kv")], check=True)
    copied = dst / "kv" / namespace.name
    shutil.rmtree(copied / "meta.lance")
    with open_store(dst) as store:
        assert store.get(key(0)) is None
    return copied


def test_inspect_reports_it_and_add_key_brings_it_back(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    fill(src, MODEL, COUNT)
    copy_without_key(src, dst)
    shown = invoke("inspect", "--storage-path", dst)
    assert shown.exit_code == 0, shown.output
    assert f"{COUNT} file(s)" in shown.output and "quarantine" in shown.output
    listed = invoke("quarantine", MODEL, "--storage-path", dst, "--json")
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["files"] == COUNT
    added = invoke("quarantine", MODEL, "--add-key", src / "kv" / ".secret", "--storage-path", dst)
    assert added.exit_code == 0, added.output
    with open_store(dst) as store:
        assert all(same(store.get(key(i)), value(i)) for i in range(COUNT))
    assert (
        json.loads(invoke("quarantine", MODEL, "--storage-path", dst, "--json").stdout)["files"]
        == 0
    )


def test_delete_needs_yes_off_a_terminal_and_a_bad_key_file_is_one_line(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    fill(src, MODEL, COUNT)
    copied = copy_without_key(src, dst)
    refused = invoke("quarantine", MODEL, "--delete", "--storage-path", dst)
    assert refused.exit_code != 0 and "--yes" in refused.output
    assert len(list((copied / "quarantine").iterdir())) == COUNT
    bad = tmp_path / "not-a-key"
    bad.write_bytes(b"x" * 7)
    wrong = invoke("quarantine", MODEL, "--add-key", bad, "--storage-path", dst)
    assert wrong.exit_code != 0 and "not a Persisting root key" in wrong.output
    assert "Traceback" not in wrong.output
    deleted = invoke("quarantine", MODEL, "--delete", "--yes", "--storage-path", dst, "--json")
    assert deleted.exit_code == 0, deleted.output
    assert json.loads(deleted.stdout)["deleted_files"] == COUNT
    assert list((copied / "quarantine").iterdir()) == []
