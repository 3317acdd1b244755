"""The root's sealing keys: a changed or missing key deletes nothing (issue 47, items 1-3).

A payload file is sealed with a key of its root. These tests change that key under live
stores (two OS processes sharing a namespace, as an engine's processes do), copy a namespace
without it, and fill the disk while it is made: no acknowledged write is lost, a file that
does not verify is quarantined, never deleted, and comes back once its key is there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from persisting.errors import CapacityError, UnsafeStorageError
from persisting.kv import open_kv_store
from persisting.kv.store import KVStore
from persisting.lance_store.root_keys import KEYS_DIR, SECRET_FILE, RootKeys

MODEL = "org/model"
COUNT = 10


def key(i: int) -> str:
    return f"{MODEL}@1@0@{i:x}@bfloat16"


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") * 2048


def store(root: Path) -> KVStore:
    return open_kv_store(root, MODEL, memory_bytes=0, disk_bytes="64MiB", durability="sync")


def put_range(kv: KVStore, first: int) -> None:
    for i in range(first, first + COUNT):
        assert kv.put(key(i), value(i), fmt="binary").stored


def served(root: Path, count: int) -> int:
    with store(root) as kv:
        return sum(kv.get(key(i)) == value(i) for i in range(count))


def second_process(root: str, first: int, conn: Connection) -> None:
    """Open the namespace (making a new key if the root has none), put COUNT values, say so,
    then refresh and close when told."""
    with store(Path(root)) as kv:
        put_range(kv, first)
        conn.send("stored")
        assert conn.recv() == "refresh"
        kv.refresh()
        conn.send(kv.stats()["quarantined_files"])


def run_beside(root: Path, first: int) -> tuple[mp.process.BaseProcess, Connection]:
    ours, theirs = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=second_process, args=(str(root), first, theirs))
    child.start()
    assert ours.poll(120), "the second process did not store its values"
    assert ours.recv() == "stored"
    return child, ours


def finish(child: mp.process.BaseProcess, conn: Connection) -> int:
    conn.send("refresh")
    assert conn.poll(120)
    quarantined = conn.recv()
    child.join(60)
    assert child.exitcode == 0
    return int(quarantined)


@pytest.mark.parametrize("wipe", [[SECRET_FILE], [SECRET_FILE, KEYS_DIR]])
def test_a_key_replaced_under_live_stores_loses_no_acknowledged_write(
    tmp_path: Path, wipe: list[str]
) -> None:
    """The key is removed while this process is open; another process opens, makes a new
    one and writes; both refresh (as the vLLM catalog and the SGLang backend do on a timer),
    then this one writes again. After a reopen every one of the 30 sync puts is served.
    With ``.keys/`` wiped too, a file may be quarantined for a while, never deleted."""
    root = tmp_path / "root"
    with store(root) as kv:
        put_range(kv, 0)
        for name in wipe:
            path = root / "kv" / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        child, conn = run_beside(root, COUNT)
        kv.refresh()
        put_range(kv, 2 * COUNT)
        kv.refresh()
        finish(child, conn)
        kv.refresh()
        assert all(kv.get(key(i)) == value(i) for i in range(COUNT, 2 * COUNT))
    assert served(root, 3 * COUNT) == 3 * COUNT
    with store(root) as kv:
        assert kv.stats()["quarantined_files"] == 0
    assert list((root / "kv").glob(f"*/{'quarantine'}/*")) == []


def test_a_namespace_copied_without_its_key_is_quarantined_then_restored(
    tmp_path: Path,
) -> None:
    """``cp -a src/kv/* dst/kv/`` leaves the dotfiles behind. The copy serves from its
    metadata; once that is lost, the files that do not verify go to the quarantine (none is
    deleted), and come back whole when the source's key is added to the root."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    with store(src) as kv:
        put_range(kv, 0)
        put_range(kv, COUNT)
        namespace = kv.directory
    (dst / "kv").mkdir(parents=True, mode=0o700)
    dst.chmod(0o700)
    subprocess.run(["cp", "-a", str(namespace), str(dst / "kv")], check=True)
    copied = dst / "kv" / namespace.name
    assert served(dst, 2 * COUNT) == 2 * COUNT
    shutil.rmtree(copied / "meta.lance")
    with store(dst) as kv:
        assert kv.stats()["quarantined_files"] == 2 * COUNT
        assert all(kv.get(key(i)) is None for i in range(2 * COUNT))
    assert len(list((copied / "quarantine").iterdir())) == 2 * COUNT
    RootKeys(dst / "kv").add((src / "kv" / SECRET_FILE).read_bytes())
    with store(dst) as kv:
        assert kv.stats()["restored_files"] == 2 * COUNT
        assert all(kv.get(key(i)) == value(i) for i in range(2 * COUNT))
    # The source, losing its metadata the same way, keeps everything.
    shutil.rmtree(namespace / "meta.lance")
    assert served(src, 2 * COUNT) == 2 * COUNT


def open_fresh(root: str) -> bytes:
    RootKeys(Path(root) / "kv")
    return (Path(root) / "kv" / SECRET_FILE).read_bytes()


@pytest.mark.slow
def test_processes_making_the_key_at_once_agree_on_one(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "kv").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    with mp.get_context("spawn").Pool(8) as pool:
        keys = pool.map(open_fresh, [str(root)] * 8)
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert [p.name for p in (root / "kv").iterdir() if p.name.endswith(".tmp")] == []


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_while_making_the_key_is_a_capacity_error_and_leaves_no_key(
    tiny_fs: Path,
) -> None:
    kv_dir = tiny_fs / "kv"
    kv_dir.mkdir(mode=0o700)
    tiny_fs.chmod(0o700)
    filler = tiny_fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # fill the filesystem to its last block
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(CapacityError, match="disk is full"):
        RootKeys(kv_dir)
    assert not (kv_dir / SECRET_FILE).exists()
    assert [p.name for p in kv_dir.iterdir()] in ([], [KEYS_DIR])
    filler.unlink()
    assert len(RootKeys(kv_dir).sealing.key) == 32


def test_a_damaged_key_file_gets_advice_that_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with store(root) as kv:
        put_range(kv, 0)
    secret = root / "kv" / SECRET_FILE
    secret.write_bytes(b"short")
    with pytest.raises(UnsafeStorageError, match="move it aside") as error:
        store(root)
    assert "drop" not in str(error.value)
    secret.rename(secret.with_name(".secret.damaged"))
    assert served(root, COUNT) == COUNT  # the old key is still among the root's keys
