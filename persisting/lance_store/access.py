"""Who may read what Persisting writes: file and directory modes under a storage root.

Cached tensors are user data, so everything is private to its owner by default: directories
0700, files 0600. A deployment whose same-host readers run as other users of one group may
widen that to the group (0750/0640). Lock and counter files are always 0600: a reader never
needs them, and whoever can open a lock file can ``flock`` it and stall every writer.

Modes are set explicitly after creation (``chmod``/``fchmod``) rather than left to the
umask, so a process umask can neither widen nor silently narrow them. Directories made by an
older version with wider modes are tightened when a store opens them; the files inside are
then out of reach through their directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from persisting.errors import ConfigError, StorageIOError, UnsafeStorageError


@dataclass(frozen=True, slots=True)
class FileModes:
    """Permission bits for the directories and data files a store creates."""

    directory: int
    file: int


#: Files that grant control (locks, counters): the owner's alone, whatever the access.
CONTROL_FILE_MODE = 0o600


OWNER_ONLY = FileModes(0o700, 0o600)
GROUP_READ = FileModes(0o750, 0o640)
_BY_NAME = {"owner": OWNER_ONLY, "group": GROUP_READ}


def file_modes(access: str | FileModes | None) -> FileModes:
    """The modes of a ``storage_access`` setting (``owner`` when None)."""
    if access is None:
        return OWNER_ONLY
    if isinstance(access, FileModes):
        return access
    try:
        return _BY_NAME[access]
    except KeyError:
        raise ConfigError(
            f"storage_access must be one of {sorted(_BY_NAME)}, not {access!r}"
        ) from None


def restrict(path: str | os.PathLike[str], mode: int, *, fd: int | None = None) -> None:
    """Give ``path`` (ours) exactly the permission bits ``mode``, keeping setgid/sticky bits.

    Another user's file is left alone (we could not change it, and it is not ours to), and
    so is a read-only filesystem (the write that follows fails with a clear error instead).
    """
    try:
        info = os.fstat(fd) if fd is not None else os.lstat(path)
    except FileNotFoundError:
        return
    if info.st_uid != os.geteuid() or stat.S_ISLNK(info.st_mode):
        return
    wanted = (stat.S_IMODE(info.st_mode) & 0o7000) | mode
    if stat.S_IMODE(info.st_mode) == wanted:
        return
    with contextlib.suppress(OSError):  # best effort: e.g. a read-only filesystem
        if fd is not None:
            os.fchmod(fd, wanted)
        else:
            os.chmod(path, wanted)


def make_dir(path: Path, modes: FileModes) -> bool:
    """Create directory ``path`` with ``modes.directory`` (its parent must exist), or
    tighten an existing one we own. Returns True if it was created."""
    try:
        path.mkdir(mode=modes.directory)
        created = True
    except FileExistsError:
        if not path.is_dir():
            raise StorageIOError(f"{path} exists and is not a directory") from None
        created = False
    except OSError as exc:
        raise storage_error(f"cannot create {path}", exc) from exc
    restrict(path, modes.directory)
    return created


def check_private(path: Path, what: str) -> None:
    """Refuse ``path`` (an existing directory or key file of a storage root) unless it is
    this user's and nobody else may write it -- as ssh refuses a group-writable ``~/.ssh``.

    Whoever owns or may write a directory can rename entries in it, so another user's root,
    ``kv/`` or namespace could have values planted or swapped in. Group *read* (the
    ``group`` access) is allowed; a directory we own with wider bits than ours was
    tightened by :func:`make_dir` before this check runs.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(f"cannot check {what} {path}", exc) from exc
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeStorageError(
            f"refusing {what} {path}: it is a symbolic link (whoever owns it can point it"
            " elsewhere); give the real path"
        )
    me = os.geteuid()
    if info.st_uid != me:
        raise UnsafeStorageError(
            f"refusing {what} {path}: it belongs to {_user(info.st_uid)}, not to"
            f" {_user(me)}, who could plant or swap stored values; use a storage root that"
            " only you own (a new directory, or `chown` this one)"
        )
    if stat.S_IMODE(info.st_mode) & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        raise UnsafeStorageError(
            f"refusing {what} {path}: mode {mode:o} lets other users write it; run"
            f" `chmod go-w {path}`"
        )


def _user(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def is_open_at(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file now at ``path`` (not one unlinked or replaced since it was
    opened): a lock file's holder checks this after taking its ``flock``."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)


def open_private(path: Path, flags: int, mode: int) -> int:
    """``os.open`` a file we create or reuse, then give it exactly ``mode`` if it is ours."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as exc:
        raise storage_error(f"cannot open {path}", exc) from exc
    restrict(path, mode, fd=fd)
    return fd


def storage_error(what: str, exc: OSError) -> StorageIOError:
    """A clear :class:`StorageIOError` for an OS failure, naming a read-only root plainly."""
    if exc.errno == errno.EROFS:
        return StorageIOError(f"{what}: the storage root is on a read-only filesystem")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return StorageIOError(f"{what}: permission denied (is the storage root writable?)")
    return StorageIOError(f"{what}: {exc}")


__all__ = [
    "CONTROL_FILE_MODE",
    "GROUP_READ",
    "OWNER_ONLY",
    "FileModes",
    "check_private",
    "file_modes",
    "is_open_at",
    "make_dir",
    "open_private",
    "restrict",
    "storage_error",
]
