"""Getting one request to one member and its reply back: the local channel or a Pulsing
ask, flow control, timeouts, retries, and a transparent re-hello for a lost session.

What rides along on a request (read leases given back, hits the client served itself) is
put back when the request fails before the server could have seen it, so a failed request
never loses a release: a lost release would leave its payload file leased, renewed by
every keepalive, and never evictable.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from persisting.errors import ProtocolError, ServiceUnavailableError, SessionExpiredError
from persisting.pulsing_compat import is_pool_exhausted
from persisting.service.client.member import TRANSPORT_ERRORS, Member, MemberFailed
from persisting.service.local_channel import ChannelRefused
from persisting.service.protocol import (
    MAX_KEYS_PER_REQUEST,
    make_request,
    safe_loads,
    unwrap_reply,
)

T = TypeVar("T")

#: Broken local channels being closed in the background.
_closing: set[asyncio.Future[None]] = set()


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
        channel = member.channel
        if channel is not None and message.get("op") != "hello":
            try:
                return await with_timeout(channel.ask(message), self.timeout_s)
            except ChannelRefused:  # the server is at a cap and did not run this request:
                self.counters["channel_refused"] += 1  # Pulsing carries it, and the rest
                if member.channel is channel:
                    member.channel = None
                    task = asyncio.ensure_future(channel.close())
                    _closing.add(task)
                    task.add_done_callback(_closing.discard)
            except (ServiceUnavailableError, *TRANSPORT_ERRORS) as exc:
                if channel.broken:  # Pulsing carries the requests until it is reopened
                    member.channel = None
                    member.needs_restore = True
                    task = asyncio.ensure_future(channel.close())
                    _closing.add(task)  # keeps the task alive until it is done
                    task.add_done_callback(_closing.discard)
                raise MemberFailed(member.addr, exc) from exc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pause = 0.002
        while True:
            ref = member.next_ref()
            try:
                reply = await with_timeout(ref.ask(message), self.timeout_s)
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
                released, touched = _ride_along(member, op, args)
                message = make_request(op, sid=member.sid, model=self.model, **args)
                try:
                    reply = await self.ask(member, message)
                except BaseException:
                    # Perhaps never sent: keep what rode along for the next request (a
                    # duplicate release of a lease already given back is harmless).
                    member.pending_release[:0] = released
                    member.touched[:0] = touched
                    raise
            try:
                result = unwrap_reply(reply)
            except SessionExpiredError:
                if attempt:
                    raise
                args.pop("release", None)  # leases of a lost session are gone already
                args.pop("touch", None)
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


def _ride_along(member: Member, op: str, args: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Move pending releases and touches into ``args``; returns what was moved."""
    if op == "hello":
        return [], []
    released = member.pending_release[:MAX_KEYS_PER_REQUEST]
    if released:
        del member.pending_release[: len(released)]
        args["release"] = released
    touched = member.touched[:MAX_KEYS_PER_REQUEST]
    if touched:
        del member.touched[: len(touched)]
        args["touch"] = touched
    return released, touched


async def with_timeout(awaitable: Awaitable[T], timeout_s: float) -> T:
    """Await with a deadline (asyncio.timeout where it exists: no extra task per call)."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout_s)
    async with timeout(timeout_s):
        return await awaitable


__all__ = ["Transport", "with_timeout"]
