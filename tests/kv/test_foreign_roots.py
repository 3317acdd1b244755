"""A root nobody else controls: directories another user owns or can write are refused at
open, and payload files no store of the root wrote are never served (issue 39).

Another user is a real one: a child process that drops to an unused uid (the tests run as
root in CI, which is what lets them make one); file modes are checked for every user.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from persisting.errors import UnsafeStorageError
from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import HEADER_BYTES, FileHeader
from persisting.kv.keys import key_hash
from persisting.lance_store.root_keys import SealingKey
from persisting.queue import LanceBackend

MODEL = "org/victim-model"
OTHER_UID = 4242
AS_ROOT = os.geteuid() == 0


def key(i: int) -> str:
    return f"{MODEL}@1@0@{i:x}@bfloat16"


def as_other_user(script: str) -> None:
    """Run shell ``script`` in a process of another user (uid and gid OTHER_UID, umask 0;
    a shell, because that user may not enter the test environment's directories)."""

    subprocess.run(
        ["/bin/sh", "-c", script],
        user=OTHER_UID, group=OTHER_UID, extra_groups=[], umask=0, check=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def shared_dir():
    """A directory every user may create entries in (like /tmp: sticky, 1777), outside
    pytest's private tmp tree, which the other user cannot enter."""
    path = Path(tempfile.mkdtemp(prefix="persisting-shared-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def store(root: Path, **options: object):
    return open_kv_store(root, MODEL, memory_bytes=0, disk_bytes="16MiB", **options)


@pytest.mark.skipif(not AS_ROOT, reason="making another user's files needs root")
def test_a_root_another_user_made_is_refused(shared_dir: Path) -> None:
    """The attacker pre-creates the victim's root, world-writable: refused, naming it."""
    root = shared_dir / "root"
    as_other_user(f"mkdir -p '{root / 'kv'}'")
    with pytest.raises(UnsafeStorageError, match=f"refusing storage root {root}.*uid {OTHER_UID}"):
        store(root)
    assert not (root / "kv" / ".secret").exists()  # nothing of ours was written there


@pytest.mark.skipif(not AS_ROOT, reason="making another user's files needs root")
def test_a_kv_or_namespace_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with store(root):
        pass
    namespace = next(p for p in (root / "kv").iterdir() if not p.name.startswith("."))
    os.chown(namespace, OTHER_UID, OTHER_UID)  # swapped for one of theirs
    with pytest.raises(UnsafeStorageError, match="namespace directory"):
        store(root)
    os.chown(namespace, 0, 0)
    kv = root / "kv"
    os.chown(kv, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeStorageError, match="KV directory"):
        store(root)


def test_our_directories_left_open_are_tightened_and_a_link_inside_is_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    with store(root):
        pass
    for directory in (root, root / "kv"):
        directory.chmod(0o777)
    with store(root):
        pass
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "kv").stat().st_mode) == 0o700
    # The root itself may be a link (to a volume): its target is checked. A link under
    # it is refused (whoever made it chose where our values go).
    link = tmp_path / "link-to-root"
    link.symlink_to(root)
    with store(link):
        pass
    (root / "kv").rename(tmp_path / "elsewhere")
    (root / "kv").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeStorageError, match="symbolic link"):
        store(root)


def forged_file(root: Path, k: str, payload: bytes, secret: bytes) -> Path:
    """A payload file as a store would write it, sealed with ``secret`` (a key not the
    root's)."""
    from persisting.kv.layout import checksum, encode_value

    layout, _ = encode_value(payload, "binary")
    header = FileHeader(k, layout, checksum(payload), None)
    h = key_hash(k)
    namespace = next(p for p in (root / "kv").iterdir() if not p.name.startswith("."))
    path = namespace / "payload" / f"{h >> 56:02x}" / f"{h:016x}-{0x1234:08x}.kv"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = header.encode(SealingKey.of(secret))
    path.write_bytes(body + payload + b"\0" * (-(len(payload)) % 4096))
    assert len(body) == HEADER_BYTES
    return path


def test_files_no_store_of_the_root_wrote_are_never_served(tmp_path: Path) -> None:
    """Planted in a running store (found by the rescan an engine runs), or there at open:
    never a hit, moved to the quarantine (not deleted) and counted. A file sealed by another
    root is foreign too."""
    root = tmp_path / "root"
    with store(root) as kv:
        kv.put(key(1), b"ours" * 1024, fmt="binary")
        planted = forged_file(root, key(2), b"theirs" * 1000, b"\x00" * 32)
        kv.refresh()
        assert kv.get(key(2)) is None and not kv.contains(key(2))
        assert not planted.exists()
        assert (kv.directory / "quarantine" / planted.name).exists()
        assert kv.stats()["foreign_files"] == kv.stats()["quarantined_files"] == 1
        assert kv.get(key(1)) == b"ours" * 1024
    other = tmp_path / "other-root"
    with store(other) as elsewhere:
        elsewhere.put(key(3), b"copied" * 1000, fmt="binary")
        elsewhere.flush()
    (copied,) = (other / "kv").rglob("*.kv")
    namespace = next(p for p in (root / "kv").iterdir() if not p.name.startswith("."))
    target = namespace / "payload" / copied.parent.name / copied.name
    target.parent.mkdir(exist_ok=True)
    shutil.copy2(copied, target)
    with store(root) as kv:
        assert kv.get(key(3)) is None
        assert kv.stats()["foreign_files"] == 1
        assert kv.get(key(1)) == b"ours" * 1024


def test_the_roots_key_is_private(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with store(root):
        pass
    secret = root / "kv" / ".secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    secret.chmod(0o644)
    with store(root):
        pass  # ours: tightened
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    secret.chmod(0o666)
    with pytest.raises(UnsafeStorageError, match="key"):
        store(root)


@pytest.mark.skipif(not AS_ROOT, reason="making another user's files needs root")
def test_a_queue_bucket_of_another_user_is_refused(shared_dir: Path) -> None:
    bucket = shared_dir / "root" / "queue" / "events" / "bucket_0"
    as_other_user(f"mkdir -p '{bucket}'")
    with pytest.raises(UnsafeStorageError, match="queue bucket directory"):
        LanceBackend(bucket_id=0, storage_path=bucket)
