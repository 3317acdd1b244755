"""Reads' sightings counted on a thread of their own, a batch at a time.

A sighting counted into a namespace's shared ``reuse.bin`` is system calls (four alone,
two in a batch: :meth:`~persisting.kv.eviction.reuse.SharedReuseStats.sighted_many`),
and a read that finds its chunk costs three of its own (open, read, close). In a process
whose other threads want the interpreter too -- an engine's scheduler beside a tier's
I/O threads -- every system call is a wait to get it back, so a read that counted its own
sighting took about twice as long as its bytes. A :class:`SightingCounter` takes that off
the read: the read only queues its sighting (see :meth:`~persisting.kv.index.LruIndex.attach`)
and pokes the counter, which counts whatever is queued ``DELAY_S`` later, in one batch.

Guarantee: a read's sighting reaches the shared table within about ``DELAY_S`` (plus the
batch's own time), or once the tier's ``flush`` or ``close`` returned; until then other
processes rank the chunk by its previous sighting -- an eviction choice a little off,
never data.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: How long a first queued sighting waits for others to join its batch.
DELAY_S = 0.01


class SightingCounter:
    """Runs ``count`` (which counts every queued sighting) ``delay_s`` after a
    :meth:`poke`, on a daemon thread started at the first poke."""

    def __init__(self, count: Callable[[], None], delay_s: float = DELAY_S):
        self._count = count
        self._delay = delay_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        """A sighting was queued: have it counted soon."""
        if self._wake.is_set():
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(
                        target=self._run, name="persisting-kv-sightings", daemon=True
                    )
                    self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stop.wait(self._delay):
                return  # close() counts what is left
            self._wake.clear()
            try:
                self._count()
            except Exception as exc:  # statistics: never worth a thread's death
                log.warning("counting sightings failed: %s", exc)
            # close() sets the stop before the wake: a wake it set that the clear above
            # erased is seen here, else the next wait would never end (and close's join)
            if self._stop.is_set():
                return

    def close(self) -> None:
        """Stop the thread, then count what is still queued (in the caller's thread)."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join()
        self._count()


__all__ = ["DELAY_S", "SightingCounter"]
