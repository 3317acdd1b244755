"""Time in tests, without sleeping for it: one helper that waits for a condition, and a
clock a test moves by hand.

Tests never assert how long something took (the machines running them are shared and
their load varies): they wait for what must happen, up to a generous deadline that only
a hang reaches, and move an injected clock past a TTL instead of sleeping through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: How long :func:`wait_until` waits by default: far beyond any healthy wait, so reaching
#: it means a hang, not a slow machine.
HANG_S = 60.0


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = HANG_S) -> None:
    """Return once ``condition()`` is true; AssertionError naming ``what`` if it is still
    false after ``timeout_s`` seconds (a hang)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def finishes(fn: Callable[[], object], timeout_s: float = HANG_S) -> bool:
    """Run ``fn`` on a thread; True if it returned within ``timeout_s`` (a hang is False,
    not a stuck test run)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


class ManualClock:
    """A monotonic clock that moves only when told (:meth:`advance`): pass it where a
    component takes ``clock=`` and step past a TTL instead of sleeping through it."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


__all__ = ["HANG_S", "ManualClock", "finishes", "wait_until"]
