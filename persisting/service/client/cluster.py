"""The members a client knows: discovery, hello, keepalive, failure marking, placement.

Every storage actor registered under the service's name is a member. The client opens a
session on each (``hello``), maps its shared pool and opens its local channel when they
share a host, renews the sessions in the background, and takes a member that fails a
request out of use until a probe reaches it again. Keys are placed on members by
rendezvous hashing (:mod:`persisting.service.routing`); :meth:`Cluster.on_owners` runs
one owner's share of a batch at a time and moves a failed owner's share to the next live
member in each key's ranking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from persisting.config import ServiceSettings
from persisting.errors import (
    AccessDeniedError,
    PersistingError,
    ServiceUnavailableError,
    StorageIOError,
)
from persisting.service.client.bulk import (
    BulkLink,
    ConnectionLost,
    Endpoint,
    Refused,
    Unreachable,
)
from persisting.service.client.member import TRANSPORT_ERRORS, Member, MemberFailed
from persisting.service.client.transport import Transport
from persisting.service.local_channel import LocalChannel
from persisting.service.protocol import make_request, unwrap_reply
from persisting.service.routing import Membership, group_by_owner
from persisting.service.same_host import ClientArena
from persisting.shm import SharedPoolReader

logger = logging.getLogger("persisting.service.client")

T = TypeVar("T")


class Cluster:
    """The members serving one model under one actor name, as one client sees them."""

    def __init__(
        self,
        system: Any,
        name: str,
        model: str,
        service: ServiceSettings,
        counters: Counter[str],
        arena: ClientArena | None,
    ):
        self.system = system
        self.name = name
        self.model = model
        self.counters = counters
        self.arena = arena
        self.max_inflight = service.max_inflight
        self.bulk_streams = service.bulk_streams
        self.bulk_sealed = service.bulk_sealed
        self.bulk_poll_s = service.bulk_poll_us / 1e6
        self.timeout_s = service.request_timeout_s
        #: Largest payload part in one message (the smaller of ours and the servers').
        self.message_part_bytes = service.message_part_bytes
        self.membership = Membership(retry_s=service.member_retry_s)
        self.members: dict[str, Member] = {}
        self.transport = Transport(
            model,
            service.request_timeout_s,
            counters,
            rehello=self.hello,
            answered=lambda member: self.mark_up(member.addr),
            restore=self.restore,
        )
        #: How long discovery waits, at most, for servers the live ones know of.
        self.settle_s = service.settle_s
        #: Set once the first discovery is done: members found later are logged.
        self._connected = False
        #: Members logged as down and not yet as back (one line each way).
        self._logged_down: set[str] = set()

    async def call(self, member: Member, op: str, **args: Any) -> Any:
        return await self.transport.call(member, op, **args)

    # -- discovery -----------------------------------------------------------------------

    async def discover(
        self, min_members: int = 0, wait_s: float = 0.0, settle: bool = False
    ) -> None:
        """Learn the members registered under ``name``; wait for ``min_members`` of them.

        With ``settle`` (a new client, before its first placement), also wait -- at most
        ``service.settle_s`` -- until this client's view holds every server the live ones
        report seeing: a client that placed keys over part of the cluster would look for
        them on the wrong members until its view caught up.

        A member that answers but does not serve the model is an AccessDeniedError at
        once when no member found serves it: waiting would not change its answer.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + wait_s
        while True:
            found = await self._instances()
            refused: list[str] = []
            for addr, node_id in found.items():
                known = self.members.get(addr)
                if known is None or known.node_id != node_id:  # new, or restarted
                    try:
                        await self._attach(addr, node_id)
                        if known is None and self._connected:
                            logger.info("kv service member %s joined", addr)
                        self.mark_up(addr)
                    except AccessDeniedError as exc:
                        refused.append(str(exc))
                    except (MemberFailed, PersistingError):
                        pass
            live = [a for a in found if a in self.members]
            self.membership.update(live)
            unseen = self._unseen(found) if settle else set()
            settling = unseen and loop.time() < min(deadline, started + self.settle_s)
            if len(live) >= min_members and not settling:
                self._connected = True
                return
            if refused and not live:
                raise AccessDeniedError(refused[0])
            if loop.time() >= deadline:
                raise ServiceUnavailableError(
                    f"found {len(live)} {self.name!r} server(s) serving {self.model!r}; "
                    f"wanted {min_members} (is the server up, and the passphrase right?)"
                )
            await asyncio.sleep(0.2)

    def _unseen(self, found: dict[str, int]) -> set[str]:
        """Servers the attached members report seeing alive that this client has not found
        yet (their gossip reached them; ours has not)."""
        reported: set[str] = set()
        for member in self.members.values():
            reported.update(str(a) for a in member.info.get("members") or ())
        return reported - set(found)

    async def _instances(self) -> dict[str, int]:
        try:
            instances = await self.system.get_named_instances(self.name)
        except TRANSPORT_ERRORS:
            return {}
        return {
            str(i["addr"]): int(i["node_id"])
            for i in instances
            if str(i.get("status", "Alive")) == "Alive" and i.get("addr")
        }

    async def _attach(self, addr: str, node_id: int) -> None:
        try:
            ref = await self.system.resolve_named(self.name, node_id=node_id)
        except TRANSPORT_ERRORS as exc:
            raise MemberFailed(addr, exc) from exc
        member = Member(
            addr=addr, node_id=node_id, refs=[ref], semaphore=asyncio.Semaphore(self.max_inflight)
        )
        previous = self.members.get(addr)
        if previous is not None:  # it restarted: what the old process held is gone
            await self._drop_same_host(previous)
            self.drop_bulk(previous)
            member.loans = previous.loans  # freed once the old process is known gone
        try:
            await self.hello(member)
            if self.model not in member.info.get("models", ()):
                raise AccessDeniedError(
                    f"{addr} serves {member.info.get('models')}, not {self.model!r}"
                )
        except BaseException:
            await self._drop_same_host(member)
            self.drop_bulk(member)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.call(member, "bye"), timeout=0.5)
            raise
        lanes = []
        for lane in member.info.get("lanes", ()):
            with contextlib.suppress(*TRANSPORT_ERRORS):
                lanes.append(await self.system.resolve_named(lane, node_id=node_id, timeout=2.0))
        if lanes:
            member.refs = lanes
        self.members[addr] = member
        self.membership.add(addr)

    async def hello(self, member: Member) -> None:
        """Open a session on ``member`` (and its same-host paths, if it maps our arena)."""
        client_info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
        arena = self.arena
        if arena is not None:
            client_info["arena"] = {
                "path": str(arena.path),
                "size": arena.size,
                "nonce": arena.nonce,
            }
        message = make_request("hello", model=self.model, client=client_info)
        info = unwrap_reply(await self.transport.ask(member, message))
        member.info = info
        member.sid = info["sid"]
        member.same_host = bool(info.get("shm")) and arena is not None
        member.semaphore = asyncio.Semaphore(
            min(self.max_inflight, int(info.get("max_inflight", 16)))
        )
        part = info.get("message_part_bytes")
        if isinstance(part, int) and part > 0:
            self.message_part_bytes = min(self.message_part_bytes, part)
        await self._drop_same_host(member)
        self._open_bulk(member)
        await self.restore(member)

    def _open_bulk(self, member: Member) -> None:
        """Data connections with the session's new credential (another host only; the old
        credential died with the old session)."""
        self.drop_bulk(member)
        if member.same_host:
            return
        endpoint = Endpoint.from_hello(member.info.get("bulk"), member.addr, self.bulk_sealed)
        if endpoint is not None:
            member.bulk = BulkLink(
                endpoint,
                streams=self.bulk_streams,
                timeout_s=self.timeout_s,
                poll_s=self.bulk_poll_s,
            )

    @staticmethod
    def drop_bulk(member: Member) -> None:
        if member.bulk is not None:
            link, member.bulk = member.bulk, None
            link.close()

    async def over_data_path(self, member: Member, op: Callable[[BulkLink], Awaitable[T]]) -> T:
        """``op(link)`` run on one of ``member``'s data connections, with the data path's
        failure rules: a connection lost mid-request is tried once more on a fresh one
        (what it carried was never delivered, and gets and puts are idempotent); a refused
        credential once more after a new ``hello``; a member that cannot be reached, or
        stalls past the timeout, raises MemberFailed (its keys are then misses)."""
        lost = refused = False
        while True:
            link = member.bulk
            if link is None:
                raise MemberFailed(member.addr, ConnectionLost("no data connections"))
            sid = member.sid
            try:
                return await op(link)
            except Refused as exc:
                if refused:
                    raise MemberFailed(member.addr, exc) from exc
                refused = True
                await self.rehello(member, sid)
            except Unreachable as exc:
                raise MemberFailed(member.addr, exc) from exc
            except ConnectionLost as exc:
                self.counters["bulk_connections_lost"] += 1
                if exc.timed_out or lost:
                    raise MemberFailed(member.addr, exc) from exc
                lost = True

    async def rehello(self, member: Member, sid: str | None) -> None:
        """A new session on ``member`` unless another task opened one since ``sid``."""
        async with member.hello_lock:
            if member.sid == sid:
                await self.hello(member)  # a transport failure is MemberFailed

    async def restore(self, member: Member) -> None:
        """Map the member's shared pool and open its local channel (same host only)."""
        member.needs_restore = False
        if not member.same_host:
            return
        pool = member.info.get("pool")
        if member.pool is None and isinstance(pool, dict):
            try:
                member.pool = SharedPoolReader(str(pool["path"]), int(pool["size"]))
            except (StorageIOError, KeyError, TypeError, ValueError):
                member.pool = None  # e.g. another mount namespace: the arena path still works
        path = member.info.get("local_channel")
        if member.channel is None and path:
            try:
                member.channel = await LocalChannel.open(str(path), member.sid)
            except (OSError, ServiceUnavailableError):  # another mount namespace, or the
                member.channel = None  # server's channel is full: stay on Pulsing

    async def _drop_same_host(self, member: Member) -> None:
        """Close the member's channel, unmap its pool and forget every location in it."""
        if member.channel is not None:
            channel, member.channel = member.channel, None
            await channel.close()
        self.forget_pool(member)

    @staticmethod
    def forget_pool(member: Member) -> None:
        if member.pool is not None:
            member.pool.close()
            member.pool = None
        member.locations.clear()
        member.touched.clear()

    # -- liveness -------------------------------------------------------------------------

    def failed(self, exc: MemberFailed) -> None:
        """Take a member out of use until a probe reaches it again (one log line when it
        goes; its later failures while down are only counted)."""
        self.counters["member_failures"] += 1
        was_live = self.membership.is_live(exc.member)
        self.membership.mark_down(exc.member)
        member = self.members.get(exc.member)
        if member is not None and member.pool is not None:
            self.forget_pool(member)
            member.needs_restore = True  # once it answers again
        if was_live:
            self._log_down(exc.member, exc.reason)

    def _log_down(self, addr: str, reason: str) -> None:
        if addr in self._logged_down:
            return
        self._logged_down.add(addr)
        logger.warning(
            "kv service member %s is down (%s); its keys go to the other members until "
            "a probe (every %.1fs) reaches it",
            addr,
            reason,
            self.membership.retry_s,
        )

    def mark_up(self, addr: str) -> None:
        """``addr`` answered: back in use (one log line if it was logged down)."""
        self.membership.mark_up(addr)
        if addr in self._logged_down:
            self._logged_down.discard(addr)
            logger.info("kv service member %s is back", addr)

    def keepalive_period(self) -> float:
        ttl = min(
            (float(m.info.get("lease_ttl_s", 30.0)) for m in self.members.values()), default=30.0
        )
        return max(0.2, min(ttl / 3.0, self.membership.retry_s))

    async def keepalive_round(self) -> None:
        """Pick up new or restarted members, probe failed ones, renew every session."""
        with contextlib.suppress(Exception):
            await self.discover()
        for addr in self.membership.probes_due():  # a success brings a member back
            with contextlib.suppress(MemberFailed, PersistingError):
                await self.call(self.members[addr], "renew")
        for member in list(self.members.values()):
            if not self.membership.is_live(member.addr):
                continue
            try:
                await self.call(member, "renew")
            except MemberFailed as exc:
                self.failed(exc)
            except PersistingError:
                pass

    async def close(self) -> None:
        """End every session (best effort) and release the same-host resources."""
        for member in list(self.members.values()):
            if member.sid is None or not self.membership.is_live(member.addr):
                continue
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.call(member, "bye"), timeout=2.0)
        for member in self.members.values():
            await self._drop_same_host(member)
            self.drop_bulk(member)

    # -- placement ------------------------------------------------------------------------

    def live(self) -> list[str]:
        return [m for m in self.membership.live if m in self.members]

    async def on_owners(
        self,
        keys: list[str],
        fn: Callable[[Member, list[int]], Awaitable[None]],
        on_lost: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Run ``fn(member, indices)`` for each owner's share of ``keys``, concurrently.

        A member that fails is marked down and its share placed again over the members
        still live (where a key lives while its owner is away). Keys no live member could
        take go to ``on_lost`` (reads: misses), or raise ServiceUnavailableError.
        """
        live = self.live()
        pending = list(range(len(keys)))
        if len(live) == 1 and keys:  # the common single-server case: no fan-out machinery
            pending = await self._run_share(self.members[live[0]], pending, fn)
            if not pending:
                return
        for _ in range(len(self.members) + 1):
            live = self.live()
            if not pending or not live:
                break
            groups = group_by_owner([keys[i] for i in pending], live)
            jobs = [(member, [pending[j] for j in idx]) for member, idx in groups.items()]
            outcomes = await asyncio.gather(
                *(self._run_share(self.members[m], share, fn) for m, share in jobs)
            )
            pending = [i for failed in outcomes for i in failed]
        if pending:
            if on_lost is None:
                raise ServiceUnavailableError(
                    f"no live {self.name!r} server took {len(pending)} key(s)"
                )
            on_lost(pending)

    async def _run_share(
        self,
        member: Member,
        share: list[int],
        fn: Callable[[Member, list[int]], Awaitable[None]],
    ) -> list[int]:
        try:
            await fn(member, share)
        except MemberFailed as exc:
            self.failed(exc)
            return share
        return []


__all__ = ["Cluster"]
