"""Closing, when the interpreter exits, the KV stores a process left open.

Scripts, notebooks and engines exit without ``close()`` all the time. A store's background
threads (the metadata committer, the write-behind writer) are daemons, and CPython ends a
daemon thread that takes the GIL back during finalization by unwinding it
(``pthread_exit``). A thread still inside Lance's native code at that moment is unwound
through Rust frames that catch the unwind and drop it, and glibc aborts the process
("FATAL: exception not rethrown", exit 134), skipping whatever was left to flush.

So an ``atexit`` hook (it runs after the non-daemon threads are joined, before
finalization) closes every store still open -- values acknowledged from memory are
written, metadata committed, threads joined -- and then stops the background workers of
stores that were dropped without ``close()`` (their threads keep them alive). Nothing of a
store runs native code once the hook returns, and the process exits with its own status.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


#: Open stores, then the workers that must stop after them: write-behind writers (they
#: still commit metadata), then metadata tables.
_STAGES: tuple[weakref.WeakSet[Closable], ...] = (
    weakref.WeakSet(),
    weakref.WeakSet(),
    weakref.WeakSet(),
)
STORE, WRITER, METADATA = range(3)
_LOCK = threading.Lock()


def track(closable: Closable, stage: int) -> None:
    """Close ``closable`` at exit (in ``stage`` order) unless :func:`untrack` ed first."""
    with _LOCK:
        _STAGES[stage].add(closable)


def untrack(closable: Closable, stage: int) -> None:
    with _LOCK:
        _STAGES[stage].discard(closable)


def close_all() -> None:
    """Close every tracked store and worker, in stage order (also usable before
    ``os._exit``). Failures are logged: the others are closed regardless."""
    for stage in _STAGES:
        with _LOCK:
            pending = list(stage)
        for closable in pending:
            try:
                closable.close()
            except Exception:
                log.exception("closing %r at exit failed", closable)


atexit.register(close_all)


__all__ = ["METADATA", "STORE", "WRITER", "close_all", "track", "untrack"]
