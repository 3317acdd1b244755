"""Getting one control request to one member and its reply back: a Pulsing ask, flow
control, timeouts, retries, and a transparent re-hello for a lost session.

The hits a same-host client served itself from remembered pool locations ride along on
its next request (``touch``); they are put back when the request fails before the server
could have seen it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from persisting.errors import ProtocolError, SessionExpiredError
from persisting.pulsing_compat import is_pool_exhausted
from persisting.service.client.member import TRANSPORT_ERRORS, Member, MemberFailed
from persisting.service.protocol import (
    MAX_KEYS_PER_REQUEST,
    make_request,
    safe_loads,
    unwrap_reply,
)

T = TypeVar("T")


class Transport:
    """Sends requests of one client (of one model) to its members."""

    def __init__(
        self,
        model: str,
        timeout_s: float,
        counters: Counter[str],
        rehello: Callable[[Member], Awaitable[None]],
        answered: Callable[[Member], None],
        restore: Callable[[Member], Awaitable[None]],
    ):
        self.model = model
        self.timeout_s = timeout_s
        self.counters = counters
        self._rehello = rehello
        self._answered = answered
        self._restore = restore

    async def ask(self, member: Member, message: dict[str, Any]) -> Any:
        """Send one message; a transport failure raises MemberFailed.

        Pulsing refuses an ask outright ("Connection pool exhausted") when too many
        connections to a peer are being opened at once (entry 3 of
        :mod:`persisting.pulsing_compat`). Such an ask was never sent, so it is retried
        after a pause instead of being taken for a dead member.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pause = 0.002
        while True:
            try:
                reply = await with_timeout(member.ref.ask(message), self.timeout_s)
                break
            except TRANSPORT_ERRORS as exc:
                if is_pool_exhausted(exc) and loop.time() < deadline:
                    self.counters["pool_exhausted_retries"] += 1
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 0.1)
                    continue
                raise MemberFailed(member.addr, exc) from exc
        payload = getattr(reply, "payload", None)
        if payload is not None and not isinstance(reply, dict):
            return safe_loads(payload)
        return reply

    async def call(self, member: Member, op: str, **args: Any) -> Any:
        """One request to one member: flow-controlled, with what rides along, and a
        transparent re-hello when the server lost our session (it restarted, or we were
        silent past the TTL)."""
        for attempt in range(2):
            async with member.semaphore:
                touched = _ride_along(member, op, args)  # hits: still hits after a new hello
                message = make_request(op, sid=member.sid, model=self.model, **args)
                try:
                    reply = await self.ask(member, message)
                except BaseException:  # perhaps never sent: the next request carries them
                    member.touched[:0] = touched
                    raise
            try:
                result = unwrap_reply(reply)
            except SessionExpiredError:
                if attempt:
                    raise
                async with member.hello_lock:
                    if member.sid == message["sid"]:
                        await self._rehello(member)
                if op in ("renew", "bye"):
                    return None
                continue
            self._answered(member)
            if member.needs_restore and op != "bye":  # back after a failure
                await self._restore(member)
            return result
        raise ProtocolError("unreachable")  # pragma: no cover


def _ride_along(member: Member, op: str, args: dict[str, Any]) -> list[str]:
    """Move pending touches into ``args`` (unless a retry carries some already); returns
    what was moved."""
    if op == "hello" or "touch" in args:
        return []
    touched = member.touched[:MAX_KEYS_PER_REQUEST]
    if touched:
        del member.touched[: len(touched)]
        args["touch"] = touched
    return touched


async def with_timeout(awaitable: Awaitable[T], timeout_s: float) -> T:
    """Await with a deadline (asyncio.timeout where it exists: no extra task per call)."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout_s)
    async with timeout(timeout_s):
        return await awaitable


__all__ = ["Transport", "with_timeout"]
