"""The keys that seal what a storage root's KV stores write.

A payload file's header is sealed with an HMAC under a key of its root (see
:mod:`persisting.kv.disk.file_header`): a file whose seal verifies under none of the root's keys
was planted or copied in from elsewhere, and is never served. The keys live under ``kv/``:

``kv/.secret``
    the current key (32 random bytes), which new stores seal with;
``kv/.keys/<id>``
    every key a store of this root has sealed with, by its id (a hash of the key, which says
    nothing of it). A header names the id of its key.

Keys are only ever added: a ``.secret`` replaced under live stores (removed, then made anew
by the next store to open) leaves the old key in ``.keys/``, where each live store puts its
own key back if it is missing, so one process never judges another's files by the wrong
key. Each file is written aside, fsynced, then linked into place (``link`` fails if a file
is there, so two processes creating the key at once agree on one); a store that cannot
write it gets a :class:`~persisting.errors.CapacityError` for a full disk, never a partial
key. To move a namespace to another root, copy ``kv/.secret`` and ``kv/.keys/`` with it:
files whose key is missing are quarantined, not deleted, and come back once it is there.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from persisting.errors import CapacityError, UnsafeStorageError
from persisting.lance_store.access import (
    CONTROL_FILE_MODE,
    OWNER_ONLY,
    check_private,
    make_dir,
    restrict,
    storage_error,
)
from persisting.lance_store.durable import fsync_dir

#: Under ``kv/``: the current key.
SECRET_FILE = ".secret"
#: Under ``kv/``: every key of the root, by id.
KEYS_DIR = ".keys"
SECRET_BYTES = 32
_ID_BYTES = 8


def key_id(key: bytes) -> str:
    """The id of ``key``: what a header names it by (a hash: it reveals nothing of the key)."""
    return hashlib.sha256(b"persisting-key-id\0" + key).digest()[:_ID_BYTES].hex()


@dataclass(frozen=True, slots=True)
class SealingKey:
    """A key and its id."""

    id: str
    key: bytes

    @classmethod
    def of(cls, key: bytes) -> SealingKey:
        return cls(key_id(key), key)


class RootKeys:
    """The sealing keys of one storage root's ``kv/`` directory.

    :attr:`sealing` is the key this process seals with: the root's current key when it
    opened. :meth:`find` looks a key up by id among every key of the root, reading
    ``.keys/`` again when it changed. :meth:`changed` says whether the root's current key is
    no longer the one this process opened with, and puts ours back in ``.keys/`` so other
    processes still verify what we wrote.
    """

    def __init__(self, kv_dir: Path):
        self.kv_dir = kv_dir
        self.secret_path = kv_dir / SECRET_FILE
        self.keys_dir = kv_dir / KEYS_DIR
        self._lock = threading.Lock()
        self._known: dict[str, bytes] = {}
        self._listed: tuple[int, int] | None = None
        self.sealing = self._open_current()
        self._keep(self.sealing)
        self._known[self.sealing.id] = self.sealing.key

    # -- lookups ---------------------------------------------------------------------------

    def find(self, kid: str) -> bytes | None:
        """The key with id ``kid``, or None if the root has none such."""
        with self._lock:
            key = self._known.get(kid)
            if key is None and self._reload():
                key = self._known.get(kid)
            return key

    def all(self) -> list[bytes]:
        """Every key of the root (for headers written before keys had ids)."""
        with self._lock:
            self._reload()
            return list(self._known.values())

    def changed(self) -> bool:
        """Whether the root's current key is not the one this process seals with (removed or
        replaced under it); if so ours is put back among the root's keys."""
        try:
            current = self.secret_path.read_bytes()
        except FileNotFoundError:
            current = b""
        except OSError:
            return True
        if current == self.sealing.key:
            return False
        self._keep(self.sealing)
        return True

    def add(self, key: bytes) -> SealingKey:
        """Make ``key`` (another root's, or an old one kept elsewhere) a key of this root:
        files sealed with it verify from now on."""
        if len(key) != SECRET_BYTES:
            raise UnsafeStorageError(f"a key is {SECRET_BYTES} bytes, not {len(key)}")
        sealing = SealingKey.of(key)
        self._keep(sealing)
        with self._lock:
            self._known[sealing.id] = key
        return sealing

    # -- files -----------------------------------------------------------------------------

    def _open_current(self) -> SealingKey:
        path = self.secret_path
        if not path.exists():
            _publish(path, secrets.token_bytes(SECRET_BYTES))
        check_private(path, "the storage root's key")
        restrict(path, CONTROL_FILE_MODE)  # ours: nobody else reads it
        try:
            key = path.read_bytes()
        except OSError as exc:
            raise storage_error(f"cannot read {path}", exc) from exc
        if len(key) != SECRET_BYTES:
            raise UnsafeStorageError(
                f"{path} is damaged ({len(key)} bytes, {SECRET_BYTES} expected): move it aside"
                f" (`mv {path} {path}.damaged`) and reopen; a new key is made, and chunks"
                f" sealed with a key not in {self.keys_dir} are quarantined, never deleted"
            )
        return SealingKey.of(key)

    def _keep(self, sealing: SealingKey) -> None:
        """Have ``sealing`` among the root's keys (``.keys/<id>``)."""
        make_dir(self.keys_dir, OWNER_ONLY)  # the keys are the owner's alone, whatever the access
        check_private(self.keys_dir, "the storage root's key directory")
        path = self.keys_dir / sealing.id
        if not path.exists():
            _publish(path, sealing.key)

    def _reload(self) -> bool:
        """Read ``.keys/`` again if it changed since last read; True if it was read."""
        try:
            info = os.stat(self.keys_dir)
        except FileNotFoundError:
            return False
        stamp = (info.st_ino, info.st_mtime_ns)
        if stamp == self._listed:
            return False
        self._listed = stamp
        for name in os.listdir(self.keys_dir):
            if name in self._known or name.startswith("."):
                continue
            path = self.keys_dir / name
            try:
                check_private(path, "a key of the storage root")
                key = path.read_bytes()
            except (OSError, UnsafeStorageError):
                continue
            if len(key) == SECRET_BYTES and key_id(key) == name:
                self._known[name] = key
        return True


def _publish(path: Path, key: bytes) -> None:
    """Write ``key`` to ``path`` whole or not at all: aside, fsynced, then linked into place
    (a file already there wins: two processes making the key at once agree on one)."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, CONTROL_FILE_MODE)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        fsync_dir(path.parent)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CapacityError(f"cannot write {path}: the disk is full") from exc
        raise storage_error(f"cannot create {path}", exc) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(aside)


__all__ = ["KEYS_DIR", "SECRET_BYTES", "SECRET_FILE", "RootKeys", "SealingKey", "key_id"]
