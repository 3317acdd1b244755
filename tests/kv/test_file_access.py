"""Store files are private to their owner (issue 13, item 2): modes under the storage root,
and a real process of another user that can neither read cached tensors nor stall puts.

The foreign process runs as ``nobody`` (uid 65534): the tests need root to start it, as CI
has; they fail, never skip, without it.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from persisting.kv import open_kv_store
from persisting.lance_store import StorageRoot
from tests.kv.kv_helpers import MODEL, key, tensor

MiB = 1 << 20
NOBODY = 65534


def foreign_attempts(lock: Path, files: list[Path], report: int) -> None:
    """What a process of another user tries (runs as nobody, in a forked child): read every
    file, then open the lock file and hold ``flock -x`` on it. Reports through ``report``."""
    readable = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                f.read(1)
            readable += 1
        except OSError:
            pass
    os.write(report, f"uid {os.getuid()} readable {readable}\n".encode())
    try:
        fd = os.open(lock, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(report, b"locked\n")
        signal.pause()  # holds the lock until the test kills it
    except OSError as exc:
        os.write(report, f"denied {type(exc).__name__}\n".encode())


def as_nobody(lock: Path, files: list[Path]) -> tuple[int, io.TextIOWrapper]:
    """Fork a child that becomes uid/gid 65534 and runs :func:`foreign_attempts`; returns
    its pid and its report stream. (Forked rather than exec'd: the test's interpreter may
    live where nobody cannot execute it.)"""
    assert os.geteuid() == 0, "these tests start a process of another user: run them as root"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls from here on, then _exit
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            foreign_attempts(lock, files, write_end)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    return pid, io.TextIOWrapper(os.fdopen(read_end, "rb"))


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory other users may enter (as /tmp is): only the storage root guards it."""
    base = Path(tempfile.mkdtemp(prefix="persisting-access-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def modes_under(root: Path) -> dict[Path, int]:
    out = {root: stat.S_IMODE(root.lstat().st_mode)}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            out[path] = stat.S_IMODE(path.lstat().st_mode)
    return out


def fill(root: Path, **options) -> None:
    with open_kv_store(root, MODEL, memory_bytes=8 * MiB, disk_bytes=64 * MiB, **options) as store:
        for i in range(6):
            store.put(key(i), tensor(i))
        store.flush()


def test_every_directory_is_0700_and_every_file_0600(root: Path) -> None:
    fill(root)
    modes = modes_under(root)
    wide = {str(p): oct(m) for p, m in modes.items() if m & 0o077}
    assert wide == {}
    kinds = {p.name for p in modes}
    assert {"usage.bin", ".lock", ".namespace.lock", "meta.lance", "payload", "writers"} <= kinds
    assert any(p.suffix == ".kv" for p in modes) and any(".lance" in p.name for p in modes)
    assert all(m == 0o700 for p, m in modes.items() if p.is_dir())
    assert all(m == 0o600 for p, m in modes.items() if p.is_file())


def test_group_access_widens_data_to_the_group_but_never_the_lock(root: Path) -> None:
    fill(root, storage_access="group")
    modes = modes_under(root)
    model_dir = StorageRoot(root).kv_path(MODEL)
    keys = root / "kv" / ".keys"  # the root's keys: the owner's alone, whatever the access
    assert all(m == (0o700 if p == keys else 0o750) for p, m in modes.items() if p.is_dir())
    for p, m in modes.items():
        if p.is_file():
            control = p.parent == model_dir and p.name in (
                "usage.bin",
                ".lock",
                ".namespace.lock",
                ".metadata.lock",
                "recency.bin",  # the eviction order: the owner's bookkeeping, like usage.bin
                "reuse.bin",  # the reuse counts the eviction policy ranks by: the same
            )
            control |= (
                p == root / "kv" / ".secret" or p.parent == root / "kv" / ".keys"
            )  # keys: never shared
            assert m == (0o600 if control else 0o640), (p, oct(m))


def test_directories_an_older_version_left_open_are_tightened(root: Path) -> None:
    model_dir = StorageRoot(root).kv_path(MODEL)
    (model_dir / "payload").mkdir(parents=True)
    for d in (root / "kv", model_dir, model_dir / "payload"):
        d.chmod(0o755)
    lock = model_dir / ".lock"
    lock.touch(mode=0o644)
    lock.chmod(0o644)
    fill(root)
    for path in (root / "kv", model_dir, model_dir / "payload"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


# The forked child only makes system calls; Lance's fork warning does not concern it.
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")
def test_another_user_can_neither_read_payloads_nor_stall_puts(shared_tmp: Path) -> None:
    root = shared_tmp / "root"
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        for i in range(4):
            store.put(key(i), tensor(i))
        store.flush()
        files = [p for p in root.rglob("*") if p.is_file()]
        assert len(files) > 4
        pid, report = as_nobody(store.directory / ".lock", files)
        try:
            who = report.readline().split()
            attempt = report.readline().split()
            # Whatever it managed, puts must go on while it tries to hold the lock.
            done = threading.Event()

            def put_more() -> None:
                for i in range(4, 8):
                    store.put(key(i), tensor(i))
                done.set()

            threading.Thread(target=put_more, daemon=True).start()
            assert done.wait(30), f"puts stalled by another user's flock ({attempt})"
            assert who == ["uid", str(NOBODY), "readable", "0"], who
            assert attempt[0] == "denied", attempt
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            report.close()
        assert all(torch.equal(store.get(key(i)), tensor(i)) for i in range(8))
