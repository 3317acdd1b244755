"""Time in tests, without sleeping for it: one helper that waits for a condition (and its
form for an event loop), and a clock a test moves by hand.

Tests never assert how long something took (the machines running them are shared and
their load varies): they wait for what must happen, up to a generous deadline that only
a hang reaches, and move an injected clock past a TTL instead of sleeping through it.
A test sleeps only where a real duration is what it is about (a peer that trickles, a
stall), and says so; ``tests/test_architecture.py`` holds the list.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable

#: How long :func:`wait_until` waits by default: far beyond any healthy wait, so reaching
#: it means a hang, not a slow machine.
HANG_S = 60.0


class _Polls:
    """The one schedule every wait here follows: pauses that start at 1 ms and double up
    to 50 ms, until ``timeout_s`` has passed (then AssertionError naming ``what``)."""

    def __init__(self, what: str, timeout_s: float):
        self.what, self.timeout_s = what, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.pause = 0.001

    def next_pause(self) -> float:
        if time.monotonic() > self.deadline:
            raise AssertionError(f"{self.what}: not seen within {self.timeout_s:.0f} s")
        pause, self.pause = self.pause, min(self.pause * 2, 0.05)
        return pause


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = HANG_S) -> None:
    """Return once ``condition()`` is true; AssertionError naming ``what`` if it is still
    false after ``timeout_s`` seconds (a hang)."""
    polls = _Polls(what, timeout_s)
    while not condition():
        time.sleep(polls.next_pause())


async def wait_until_async(
    condition: Callable[[], object | Awaitable[object]], what: str, timeout_s: float = HANG_S
) -> None:
    """:func:`wait_until` inside an event loop: the loop runs on between polls, and
    ``condition`` may be a coroutine function (awaited on each poll)."""
    polls = _Polls(what, timeout_s)
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        await asyncio.sleep(polls.next_pause())


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


__all__ = ["HANG_S", "ManualClock", "finishes", "wait_until", "wait_until_async"]
