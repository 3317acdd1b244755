"""One owner per served namespace: an exclusive lock that names who holds it.

Some roles must run once per namespace of a storage root: a ``persisting serve`` server or
an LMCache L2 adapter serving a model namespace (each keeps the namespace's index in memory
and answers for it), the event consumer of a queue topic (two would apply and commit the same
events). Such a role *claims* the directory it owns: an exclusive ``flock`` on
``<dir>/.owner.lock``, taken without waiting, plus a record of the holder in
``<dir>/.owner.json`` (pid, host, role, one line saying what it is, and details such as an
adapter's capacity and its last status). A second claim fails at once with
:class:`~persisting.errors.NamespaceOwnedError` naming the holder; the kernel drops a killed
holder's lock, so a stale record never blocks anybody.

Engine processes that share a namespace through :class:`~persisting.kv.KVStore` directly
(LMCache's in-process plugin on every TP rank, the vLLM connector's workers) claim nothing:
they hold the namespace's shared lock only (:mod:`.namespace_lock`), as before.

The record outlives its holder (``live`` tells whether the lock is held now), so tools can
still show what an L2 adapter that stopped was configured with.

A lock holds only while its file is the one at the path: a claim is taken on the file found
there after the lock (one replaced meanwhile is opened again), and a holder that
:meth:`OwnerClaim.watch` es its claim finds out within :data:`WATCH_EVERY_S` when the file
was removed (``rm .owner.lock``) or replaced. It then takes the claim again on a new file if
nobody else has, so a later claimant is refused as before; if another process claimed the
directory meanwhile, the holder is told it lost the claim (a server then stops serving).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pwd
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persisting.errors import NamespaceOwnedError, StorageIOError
from persisting.lance_store.access import (
    CONTROL_FILE_MODE,
    is_open_at,
    open_private,
    restrict,
    storage_error,
)

log = logging.getLogger(__name__)

LOCK_NAME = ".owner.lock"
RECORD_NAME = ".owner.json"
#: A claim that finds the lock held tries again for this long (a reader probing the lock
#: holds it for an instant).
_RETRY_S = 0.2
#: How often a watched claim checks that its lock file is still the one at its path.
WATCH_EVERY_S = 1.0

#: Told that a watched claim was lost, with one line saying how.
LostHook = Callable[[str], None]


@dataclass(frozen=True)
class Holder:
    """Who claimed a directory: what :func:`read_owner` finds in its record."""

    pid: int
    host: str
    role: str
    what: str
    since: float
    live: bool
    details: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """``pid 4242 on node-a (persisting serve 'kvstore' on 127.0.0.1:8610)``."""
        return f"pid {self.pid} on {self.host} ({self.what})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "host": self.host,
            "role": self.role,
            "what": self.what,
            "since": self.since,
            "live": self.live,
            "details": self.details,
        }


class OwnerClaim:
    """A held claim on one directory; :meth:`release` (or process exit) lets go."""

    def __init__(self, directory: Path, fd: int, record: dict[str, Any], subject: str = ""):
        self.directory = directory
        self.subject = subject or str(directory)
        self._fd = fd
        self._record = record
        self._lock = threading.Lock()  # the descriptor and the record
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd >= 0

    @property
    def path(self) -> Path:
        """The lock file."""
        return self.directory / LOCK_NAME

    def still_here(self) -> bool:
        """Whether the lock file this claim holds is still the one at the path (not removed
        or replaced since it was locked)."""
        with self._lock:
            return self._fd >= 0 and is_open_at(self._fd, self.path)

    def check(self) -> str | None:
        """Make sure the claim still holds: when its lock file is gone from the path (or
        another file is there), lock a new one, unless another process holds that. Returns
        None while the claim holds, else one line saying how it was lost (the claim is then
        released)."""
        with self._lock:
            if self._fd < 0:
                return f"the claim on {self.subject} was released"
            if is_open_at(self._fd, self.path):
                return None
            try:
                fd = _lock_file(self.path, wait_s=0.0)
                if fd is not None:
                    _write_record(self.directory, {**self._record, "pid": os.getpid()})
            except (OSError, StorageIOError) as exc:
                lost = f"cannot lock it again: {exc}"
            else:
                if fd is not None:
                    os.close(self._fd)
                    self._fd = fd
                    log.warning(
                        "the owner lock %s was removed while this process held it; "
                        "locked a new one (a second claimant is refused again)",
                        self.path,
                    )
                    return None
                holder = read_owner(self.directory)
                named = holder.describe() if holder is not None else "another process"
                lost = f"{named} has claimed it since"
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        return (
            f"the owner lock {self.path} of {self.subject} was removed while this process "
            f"held it, and {lost}: this process no longer owns it"
        )

    def watch(self, on_lost: LostHook, every_s: float = WATCH_EVERY_S) -> None:
        """:meth:`check` the claim every ``every_s`` seconds on a thread of its own until it
        is released; ``on_lost`` gets the line saying how it was lost, once."""
        if self._watcher is not None or self._fd < 0:
            return

        def run() -> None:
            while not self._stop.wait(every_s):
                lost = self.check()
                if lost is not None:
                    if not self._stop.is_set():  # not simply released meanwhile
                        on_lost(lost)
                    return

        self._watcher = threading.Thread(target=run, name="persisting-owner-watch", daemon=True)
        self._watcher.start()

    def update(self, what: str | None = None, **details: Any) -> None:
        """Rewrite the record: a new one-line description and/or details merged in."""
        with self._lock:
            if self._fd < 0:
                return
            if what is not None:
                self._record["what"] = what
            self._record["details"] = {**self._record.get("details", {}), **details}
            self._record["updated"] = time.time()
            with contextlib.suppress(OSError, StorageIOError):  # a record is informative
                _write_record(self.directory, self._record)

    def release(self) -> None:
        self._stop.set()
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)  # closing the descriptor drops the flock
                self._fd = -1


def claim_owner(
    directory: Path,
    *,
    role: str,
    what: str,
    subject: str,
    details: Mapping[str, Any] | None = None,
    make_dir: Callable[[], object] | None = None,
    advice: str = "stop it first (one owner per namespace)",
) -> OwnerClaim:
    """Claim ``directory`` for ``role`` (``what`` says what the claimant is, in one line;
    ``subject`` names the directory in a refusal, e.g. ``model 'org/m'``, and ``advice``
    ends the refusal).

    Raises NamespaceOwnedError at once if a live process holds the claim.
    """
    if make_dir is not None:
        make_dir()
    fd = _lock_file(directory / LOCK_NAME, wait_s=_RETRY_S)
    if fd is None:
        raise _refusal(directory, subject, advice)
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "role": role,
        "what": what,
        "since": time.time(),
        "details": dict(details or {}),
    }
    try:
        _write_record(directory, record)
    except BaseException:
        os.close(fd)
        raise
    return OwnerClaim(directory, fd, record, subject)


def _lock_file(path: Path, wait_s: float) -> int | None:
    """A descriptor of the lock file at ``path`` (created if missing), exclusively locked,
    which is still the file at ``path`` once locked; None if another process holds it
    (tried again for ``wait_s`` seconds)."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
            continue
        except BaseException:
            os.close(fd)
            raise
        if is_open_at(fd, path):
            return fd
        os.close(fd)  # removed or replaced between the open and the lock: open it again


def _open_lock(path: Path) -> int:
    """Open (or create) a lock file. One this user may not open is named with its owner
    and mode (say, a stale lock left by a server that ran as another user), rather than
    blamed on the storage root."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, CONTROL_FILE_MODE)
    except PermissionError as exc:
        try:
            info = os.lstat(path)
        except OSError:  # no such file: the directory is what we may not write
            raise storage_error(f"cannot create {path}", exc) from exc
        owner = _user(info.st_uid)
        if info.st_uid != os.geteuid():
            owner += f", not to {_user(os.geteuid())} who runs this"
        raise StorageIOError(
            f"cannot open the owner lock {path}: it belongs to {owner} (mode "
            f"{info.st_mode & 0o777:04o}); if no process of that user holds it (a stale "
            f"lock), remove the file"
        ) from exc
    except OSError as exc:
        raise storage_error(f"cannot open {path}", exc) from exc
    restrict(path, CONTROL_FILE_MODE, fd=fd)
    return fd


def _refusal(directory: Path, subject: str, advice: str) -> NamespaceOwnedError:
    holder = read_owner(directory)
    named = holder.describe() if holder is not None else "another process"
    error = NamespaceOwnedError(f"{subject} is already held by {named}; {advice}")
    error.holder = holder
    return error


def read_owner(directory: Path) -> Holder | None:
    """The holder recorded in ``directory`` (``live``: its claim is held now), or None if
    nobody ever claimed it. Changes nothing (the lock is probed for an instant)."""
    try:
        text = (directory / RECORD_NAME).read_text()
        data = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return Holder(
            pid=int(data["pid"]),
            host=str(data.get("host", "")),
            role=str(data.get("role", "")),
            what=str(data.get("what", "")),
            since=float(data.get("since", 0.0)),
            live=is_claimed(directory),
            details=dict(data.get("details") or {}),
        )
    except (KeyError, TypeError, ValueError):
        return None


def is_claimed(directory: Path) -> bool:
    """Whether a live process holds ``directory``'s claim now."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _write_record(directory: Path, record: Mapping[str, Any]) -> None:
    """Replace the record whole (write, then rename): a reader never sees half of one."""
    tmp = directory / f"{RECORD_NAME}.{os.getpid()}.tmp"
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CONTROL_FILE_MODE)
    try:
        os.write(fd, json.dumps(record, sort_keys=True).encode())
    finally:
        os.close(fd)
    os.replace(tmp, directory / RECORD_NAME)


def _user(uid: int) -> str:
    """``alice (uid 1000)``, or ``uid 1000`` for a uid with no name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


__all__ = [
    "LOCK_NAME",
    "RECORD_NAME",
    "WATCH_EVERY_S",
    "Holder",
    "LostHook",
    "OwnerClaim",
    "claim_owner",
    "is_claimed",
    "read_owner",
]
