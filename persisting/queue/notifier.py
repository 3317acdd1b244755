"""Waking readers that wait for new records, on any event loop, from any thread.

A put (on the writer's loop or a worker thread) must wake ``get_stream`` calls waiting on
other event loops. A waiter is registered *before* the caller checks for records, so a put
between the check and the wait still wakes it, and is removed when the caller stops waiting,
however it stops: a read-only backend is never notified, and a waiter left behind on every
call would grow without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator


class Notifier:
    """Futures resolved by :meth:`notify_all`; :meth:`waiter` registers one for a block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def __len__(self) -> int:
        """How many waits are in progress."""
        with self._lock:
            return len(self._waiters)

    @contextlib.contextmanager
    def waiter(self) -> Iterator[asyncio.Future[None]]:
        """A future the next :meth:`notify_all` resolves, forgotten when the block ends."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiters.append((loop, future))
        try:
            yield future
        finally:
            with self._lock:
                self._waiters = [(lp, f) for lp, f in self._waiters if f is not future]

    @staticmethod
    async def wait(future: asyncio.Future[None], timeout: float) -> None:
        """Wait for ``future`` at most ``timeout`` seconds (a timeout is not an error)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(future, timeout)

    async def wait_until(
        self,
        arrived: Callable[[], Awaitable[bool]],
        *,
        stopped: Callable[[], bool],
        deadline: float | None,
        poll_s: float,
    ) -> bool:
        """Wait until ``arrived()`` is true (checked after each notification, and at least
        every ``poll_s`` for what no notification announces); False once ``stopped()`` or at
        ``deadline`` (a ``time.monotonic()`` value; None: no limit)."""
        while True:
            with self.waiter() as woken:
                if stopped():
                    return False
                if await arrived():
                    return True
                pause = poll_s
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    pause = min(pause, left)
                await self.wait(woken, pause)

    def notify_all(self) -> None:
        """Resolve every registered future, each on its own loop."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that loop is closed
                continue


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


__all__ = ["Notifier"]
