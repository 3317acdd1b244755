"""Arena regions lent to a server, and when they may be used again.

A same-host put copies a value into the client's arena and the server reads it from
there; a same-host get may offer a window of the arena for the server to copy values into.
Either way the server touches the pages *while the request runs*, and a client whose
request was cancelled or timed out cannot tell whether it has yet. Reusing those pages at
once let a later put overwrite a cancelled put's bytes before the server read them, which
stored another key's value under the cancelled key.

So every such request carries a ticket. When it ends with an answer (a result or an error
the server sent), the server is done with the pages. When it ends otherwise, the regions
go into quarantine under the ticket, and the client *withdraws* the ticket: the server
answers with the tickets it will never touch the arena for again (not running now; a
request arriving later is refused), and only their regions are freed. Regions lent to a
session the client can no longer ask about stay out of use for the arena's life (counted
in ``arena_quarantined_bytes``), unless the server's process is known to be gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from persisting.errors import PersistingError
from persisting.service.client.member import Loan, Member, MemberFailed
from persisting.service.same_host import ClientArena, Region
from persisting.shm import pid_alive

#: Pauses between withdrawals of tickets still running on the server (seconds).
_SETTLE_PAUSES = (0.002, 0.01, 0.05, 0.2, 1.0)


class ArenaLoans:
    """Tickets for requests that lend arena regions, and the quarantine of their regions."""

    def __init__(
        self,
        arena: ClientArena,
        counters: Counter[str],
        call: Callable[..., Awaitable[Any]],
    ):
        self.arena = arena
        self.counters = counters
        self._call = call
        self._tickets = itertools.count(1)
        self._settling: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def lend(self, member: Member, regions: list[Region], op: str, **args: Any) -> Any:
        """``op`` with ``regions`` lent to ``member``'s server for its duration.

        When the request ends with an answer, the caller has its regions back (to free, or
        to hand out what the server copied into them). When it ends any other way
        (cancelled, timed out, the member failed), the regions are quarantined here and
        must not be touched by the caller again.
        """
        ticket = next(self._tickets)
        try:
            return await self._call(member, op, ticket=ticket, **args)
        except PersistingError:
            raise  # the server answered: it is done with the pages
        except BaseException:
            self._quarantine(member, ticket, regions)
            raise

    def _quarantine(self, member: Member, ticket: int, regions: list[Region]) -> None:
        if not regions:
            return
        member.loans[ticket] = Loan(member.sid, member.pid if member.same_host else None, regions)
        self.counters["arena_quarantined_bytes"] += sum(r.capacity for r in regions)
        if member.addr not in self._settling:
            try:
                task = asyncio.get_running_loop().create_task(self._settle_soon(member))
            except RuntimeError:  # no loop (shutting down): the keepalive or close settles
                return
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _settle_soon(self, member: Member) -> None:
        self._settling.add(member.addr)
        try:
            for pause in _SETTLE_PAUSES:
                await asyncio.sleep(pause)
                if not await self.settle(member):
                    return
        finally:
            self._settling.discard(member.addr)

    async def settle(self, member: Member) -> bool:
        """Withdraw the member's outstanding tickets and free the regions the server says
        it will never touch again. True while some remain lent."""
        for ticket, loan in list(member.loans.items()):
            if loan.pid is not None and not pid_alive(loan.pid):
                self._free(member, ticket)  # that server process is gone: nobody touches them
        tickets = [t for t, loan in member.loans.items() if loan.sid == member.sid]
        if tickets and member.sid is not None:
            try:
                safe = await self._call(member, "withdraw", tickets=tickets)
            except (MemberFailed, PersistingError):
                return True
            for ticket in safe:
                self._free(member, ticket)
        return any(loan.sid == member.sid for loan in member.loans.values())

    def _free(self, member: Member, ticket: int) -> None:
        loan = member.loans.pop(ticket, None)
        if loan is None:
            return
        for region in loan.regions:
            self.arena.free(region)
            self.counters["arena_quarantined_bytes"] -= region.capacity
            self.counters["arena_withdrawn_bytes"] += region.capacity

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task


__all__ = ["ArenaLoans"]
