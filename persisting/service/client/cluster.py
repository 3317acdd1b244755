"""The members a client knows: discovery, hello, keepalive, failure marking, placement.

Every storage actor registered under the service's name is a member. The client opens a
session on each (``hello``), which names the member's data path: its Unix socket and
shared pool are used when they share a host, its TCP port otherwise. It renews the
sessions in the background, and takes a member that fails a request out of use until a
probe reaches it again. Keys are placed on members by
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
from concurrent.futures import Executor
from typing import Any, TypeVar

from persisting.config import ServiceSettings
from persisting.errors import (
    AccessDeniedError,
    CapacityError,
    InvalidKeyError,
    InvalidNameError,
    PersistingError,
    ServiceUnavailableError,
    StorageIOError,
)
from persisting.service.client.link import (
    Closed,
    ConnectionLost,
    DataLink,
    Endpoint,
    Unreachable,
)
from persisting.service.client.member import TRANSPORT_ERRORS, Member, MemberFailed
from persisting.service.client.transport import Transport
from persisting.service.protocol import make_request, unwrap_reply
from persisting.service.routing import Membership, group_by_owner, rank_members
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
        *,
        same_host: bool,
        readers: Executor,
        role: str | None = None,
    ):
        self.system = system
        self.name = name
        self.model = model
        self.counters = counters
        #: Whether members on this host are reached over their Unix socket and pool.
        self.same_host = same_host
        self.readers = readers
        #: What this client says it is in its hello (a member's replicator: "copies").
        self.role = role
        self.max_inflight = service.max_inflight
        self.bulk_streams = service.bulk_streams
        self.timeout_s = service.request_timeout_s
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

        A member that answers but does not serve the model (or refuses its name) raises
        that error at once when no member found serves it: waiting would not change its
        answer.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + wait_s
        while True:
            found = await self._instances()
            refused: list[PersistingError] = []
            for addr, node_id in found.items():
                known = self.members.get(addr)
                if known is None or known.node_id != node_id:  # new, or restarted
                    try:
                        await self._attach(addr, node_id)
                        if known is None and self._connected:
                            logger.info("kv service member %s joined", addr)
                        self.mark_up(addr)
                    except (AccessDeniedError, InvalidKeyError, InvalidNameError) as exc:
                        refused.append(exc)  # an answer that waiting would not change
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
                raise refused[0]
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
            addr=addr, node_id=node_id, ref=ref, semaphore=asyncio.Semaphore(self.max_inflight)
        )
        previous = self.members.get(addr)
        if previous is not None:  # it restarted: what the old process held is gone
            self.drop_data_path(previous)
        try:
            await self.hello(member)
            if self.model not in member.info.get("models", ()):
                raise AccessDeniedError(
                    f"{addr} serves {member.info.get('models')}, not {self.model!r}"
                )
        except BaseException:
            self.drop_data_path(member)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.call(member, "bye"), timeout=0.5)
            raise
        self.members[addr] = member
        self.membership.add(addr)

    async def hello(self, member: Member) -> None:
        """Open a session on ``member``, and its data path with the session's credential
        (the old credential died with the old session)."""
        client_info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
        if self.role is not None:
            client_info["role"] = self.role
        message = make_request("hello", model=self.model, client=client_info)
        info = unwrap_reply(await self.transport.ask(member, message))
        member.info = info
        member.sid = info["sid"]
        member.semaphore = asyncio.Semaphore(
            min(self.max_inflight, int(info.get("max_inflight", 16)))
        )
        self.drop_data_path(member)
        endpoint = Endpoint.from_hello(info.get("data"), member.addr)
        if endpoint is not None:
            unix = (
                self.same_host
                and endpoint.unix is not None
                and info.get("node", {}).get("host") == socket.gethostname()
                and os.path.exists(endpoint.unix)
            )
            self._link(member, endpoint, unix)
        await self.restore(member)

    def _link(self, member: Member, endpoint: Endpoint, unix: bool) -> None:
        member.link = DataLink(
            endpoint,
            unix=unix,
            streams=self.bulk_streams,
            timeout_s=self.timeout_s,
            readers=self.readers,
        )

    def drop_data_path(self, member: Member) -> None:
        """Close the member's data connections, unmap its pool, forget every location."""
        if member.link is not None:
            link, member.link = member.link, None
            link.close()
        self.forget_pool(member)

    async def over_data_path(self, member: Member, op: Callable[[DataLink], Awaitable[T]]) -> T:
        """``op(link)`` run on one of ``member``'s data connections, with the data path's
        failure rules:

        * a connection lost mid-request is tried once more on a fresh one (what it carried
          was never delivered, and gets and puts are idempotent); one that stalls past the
          timeout, or a member that cannot be reached, raises MemberFailed (its keys are
          then misses); a Unix socket that cannot be reached is given up for TCP;
        * a new connection closed before it was authenticated: ``renew`` tells whether the
          session is gone (a new ``hello`` follows) or the server is busy; one over the
          server's caps is busy too. A busy server is asked again, pausing longer each
          time, until ``request_timeout_s`` is spent: then ServiceUnavailableError (or the
          CapacityError) says so, and the member stays in use.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        lost = False
        pause = 0.05
        while True:
            link = member.link
            if link is None:
                raise MemberFailed(member.addr, ConnectionLost("no data path"))
            try:
                return await op(link)
            except Unreachable as exc:
                if not link.unix:
                    raise MemberFailed(member.addr, exc) from exc
                self.forget_pool(member)  # not on this host after all
                self._link(member, link.endpoint, unix=False)
                continue
            except ConnectionLost as exc:
                self.counters["data_connections_lost"] += 1
                if exc.timed_out or lost:
                    raise MemberFailed(member.addr, exc) from exc
                lost = True
                continue
            except Closed as exc:
                self.counters["data_connections_closed"] += 1
                await self.call(member, "renew")  # a lost session: a new hello, a new link
                busy: PersistingError = ServiceUnavailableError(
                    f"{member.addr} closed new data connections before authenticating them "
                    f"for {self.timeout_s:.0f}s although our session is valid: it is busy "
                    f"(every slot for unauthenticated connections taken; last: {exc})"
                )
            except CapacityError as exc:
                self.counters["data_connections_over_cap"] += 1
                busy = exc
            if loop.time() + pause > deadline:
                raise busy
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    async def rehello(self, member: Member, sid: str | None) -> None:
        """A new session on ``member`` unless another task opened one since ``sid``."""
        async with member.hello_lock:
            if member.sid == sid:
                await self.hello(member)  # a transport failure is MemberFailed

    async def restore(self, member: Member) -> None:
        """Map the member's shared pool (same host only)."""
        member.needs_restore = False
        pool = member.info.get("pool")
        if member.same_host and member.pool is None and isinstance(pool, dict):
            try:
                member.pool = SharedPoolReader(str(pool["path"]), int(pool["size"]))
            except (StorageIOError, KeyError, TypeError, ValueError):
                member.pool = None  # e.g. another /dev/shm: values come over the socket

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
            self.drop_data_path(member)

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

    @property
    def replicas(self) -> int:
        """How many members keep a copy of a key (the members' ``service.replicas``, told
        in their hello; 1 until one answered)."""
        return max((int(m.info.get("replicas", 1)) for m in self.members.values()), default=1)

    async def on_copies(
        self,
        keys: list[str],
        fn: Callable[[Member, list[int]], Awaitable[None]],
        found: Callable[[int], bool],
        on_lost: Callable[[list[int]], None] | None = None,
        *,
        together: bool = False,
    ) -> None:
        """Run ``fn(member, indices)`` over the members that hold copies of ``keys``: each
        key is asked of its first live copy-holder (the first ``replicas`` live members of
        its ranking), and a key not ``found`` there of the next -- or, ``together``, of all
        of them at once (a presence question: one round trip per member). A member that
        fails is marked down, and the keys it had are asked of the holders that remain; a
        key no holder answered for goes to ``on_lost``.
        """
        tried: list[set[str]] = [set() for _ in keys]
        answered = [False] * len(keys)
        pending = list(range(len(keys)))
        replicas = self.replicas  # read from every member's hello: once per call, not per key
        for _ in range(replicas + len(self.members) + 1):
            live = self.live()
            groups: dict[str, list[int]] = {}
            for i in pending:
                holders = rank_members(keys[i], live)[:replicas]
                untried = [m for m in holders if m not in tried[i]]
                for member in untried if together else untried[:1]:
                    tried[i].add(member)
                    groups.setdefault(member, []).append(i)
            if not groups:
                break
            jobs = list(groups.items())
            outcomes = await asyncio.gather(
                *(self._run_share(self.members[m], share, fn) for m, share in jobs)
            )
            for (_m, share), failed in zip(jobs, outcomes, strict=True):
                lost = set(failed)
                for i in share:
                    answered[i] = answered[i] or i not in lost
            pending = sorted({i for _m, share in jobs for i in share if not found(i)})
        unanswered = [i for i in range(len(keys)) if not answered[i] and not found(i)]
        if unanswered and on_lost is not None:
            on_lost(unanswered)

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
