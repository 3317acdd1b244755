"""The background thread of a bucket's writer: when to fsync the log, flush, compact, clean up
old versions and apply retention.

The worker owns the schedule only; the work is the backend's and its dataset's, handed over
as :class:`WorkerTasks`. One failing round is counted and logged, and the worker goes on after
a short pause: an exception must never stop the flushes that later puts rely on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from persisting.queue.stats import Counters

logger = logging.getLogger(__name__)

#: Old versions are cleaned up after this many flushes (and after every compaction): they
#: are cheap to delete, and every one left makes the next commits slower.
CLEANUP_EVERY_FLUSHES = 8
#: The longest the worker sleeps without looking at its schedule.
_IDLE_S = 1.0
#: Pause after a failed round, so a persistent failure does not spin.
_FAILURE_PAUSE_S = 0.5
#: Compaction rounds of :meth:`Worker.run_now` (each runs a few steps).
_MAX_COMPACTION_ROUNDS = 16


@dataclass(frozen=True)
class WorkerTasks:
    """What the worker runs: bound methods of the backend and its dataset."""

    #: Given ``time.monotonic()``: is a flush due (size or age)?
    flush_due: Callable[[float], bool]
    #: When the oldest buffered record's age makes a flush due (None: nothing buffered).
    flush_deadline: Callable[[], float | None]
    flush: Callable[[], int]
    #: Compact if there are too many small fragments; True if it did.
    compact: Callable[[], bool]
    cleanup: Callable[[], None]
    #: fsync the log (None: no log, or it is fsynced before each acknowledgement).
    sync_log: Callable[[], None] | None = None
    #: Apply retention (None: no retention configured).
    retain: Callable[[], int] | None = None


class Worker:
    """Runs :class:`WorkerTasks` on one daemon thread until :meth:`stop`."""

    def __init__(
        self,
        name: str,
        tasks: WorkerTasks,
        counters: Counters,
        *,
        fsync_interval_s: float,
        retention_interval_s: float,
        cleanup_every_flushes: int = CLEANUP_EVERY_FLUSHES,
    ):
        self.tasks = tasks
        self._cleanup_every_flushes = cleanup_every_flushes
        self._counters = counters
        self._fsync_interval_s = fsync_interval_s
        self._retention_interval_s = retention_interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Look at the schedule now (a full buffer, or compaction due)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop and wait for the thread (unless called from it)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def run_now(self) -> dict[str, int]:
        """All the maintenance at once, on the caller's thread: compaction until none is due,
        version cleanup, retention. Returns the compaction steps run and records trimmed."""
        before = self._counters.compactions
        for _ in range(_MAX_COMPACTION_ROUNDS):
            if not self.tasks.compact():
                break
        self.tasks.cleanup()
        trimmed = self.tasks.retain() if self.tasks.retain is not None else 0
        return {"compaction_steps": self._counters.compactions - before, "trimmed": trimmed}

    def _run(self) -> None:
        last_sync = last_retention = time.monotonic()
        flushes_at_cleanup = self._counters.flushes
        tasks = self.tasks
        while not self._stop.is_set():
            self._wake.wait(self._next_wakeup(last_sync, last_retention))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                now = time.monotonic()
                if tasks.sync_log is not None and now - last_sync >= self._fsync_interval_s:
                    tasks.sync_log()
                    last_sync = now
                if tasks.flush_due(now):
                    tasks.flush()
                compacted = tasks.compact()
                flushes = self._counters.flushes
                if compacted or flushes - flushes_at_cleanup >= self._cleanup_every_flushes:
                    tasks.cleanup()
                    flushes_at_cleanup = flushes
                if tasks.retain is not None and now - last_retention >= self._retention_interval_s:
                    last_retention = now
                    tasks.retain()
            except Exception:
                self._counters.errors += 1
                logger.exception("%s: background flush/maintenance failed", self._thread.name)
                self._stop.wait(_FAILURE_PAUSE_S)

    def _next_wakeup(self, last_sync: float, last_retention: float) -> float:
        now = time.monotonic()
        waits = [_IDLE_S]
        if self.tasks.sync_log is not None:
            waits.append(last_sync + self._fsync_interval_s - now)
        deadline = self.tasks.flush_deadline()
        if deadline is not None:
            waits.append(deadline - now)
        if self.tasks.retain is not None:
            waits.append(last_retention + self._retention_interval_s - now)
        return max(0.0, min(waits))


__all__ = ["CLEANUP_EVERY_FLUSHES", "Worker", "WorkerTasks"]
