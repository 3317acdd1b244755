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
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persisting.errors import NamespaceOwnedError, StorageIOError
from persisting.lance_store.access import CONTROL_FILE_MODE, is_open_at, open_private

LOCK_NAME = ".owner.lock"
RECORD_NAME = ".owner.json"
#: A claim that finds the lock held tries again for this long (a reader probing the lock
#: holds it for an instant).
_RETRY_S = 0.2


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

    def __init__(self, directory: Path, fd: int, record: dict[str, Any]):
        self.directory = directory
        self._fd = fd
        self._record = record

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def still_here(self) -> bool:
        """Whether the lock file this claim holds is still the one at the path (a drop
        renames a namespace away only while nothing holds it open)."""
        return self._fd >= 0 and is_open_at(self._fd, self.directory / LOCK_NAME)

    def update(self, what: str | None = None, **details: Any) -> None:
        """Rewrite the record: a new one-line description and/or details merged in."""
        if self._fd < 0:
            return
        if what is not None:
            self._record["what"] = what
        self._record["details"] = {**self._record.get("details", {}), **details}
        self._record["updated"] = time.time()
        with contextlib.suppress(OSError, StorageIOError):  # a record is informative only
            _write_record(self.directory, self._record)

    def release(self) -> None:
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
    fd = open_private(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE)
    deadline = time.monotonic() + _RETRY_S
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _refusal(directory, subject, advice) from None
                time.sleep(0.02)
    except BaseException:
        os.close(fd)
        raise
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
    return OwnerClaim(directory, fd, record)


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


__all__ = [
    "LOCK_NAME",
    "RECORD_NAME",
    "Holder",
    "OwnerClaim",
    "claim_owner",
    "is_claimed",
    "read_owner",
]
