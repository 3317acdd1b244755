"""KVCacheClient: the KV store's API, served by one or more KVCacheStorageActor nodes.

::

    client = await KVCacheClient.connect(seeds=["127.0.0.1:8610"], name="kvstore",
                                         model="meta-llama/Llama-3-8B")
    await client.put(key, tensor)
    tensor = await client.get(key)           # None on a miss
    hit_chunks = await client.lookup_prefix(keys)

The method names and results are those of the local :class:`persisting.kv.KVStore`;
:class:`~persisting.service.sync_client.SyncKVCacheClient` offers the same methods
without ``await``.

How it works:

* **Placement**: every storage actor registered under ``name`` is a member; each key goes
  to one member by rendezvous hashing (:mod:`persisting.service.routing`). A member that
  fails a request is left out until a probe reaches it again: its keys are misses
  (recompute) and its puts go to the next member in the key's ranking. Nothing is
  replicated.
* **Flow control**: at most ``max_inflight`` (<= 16, Pulsing's connection pool) requests are
  in flight per member, spread over the member's lanes (actors that share its stores).
* **Same host** (:mod:`persisting.service.same_host`, :mod:`~.local_channel`): requests go
  over the server's Unix socket; memory-tier values are copied by the client straight out
  of the server's shared memory pool (mapped read-only), into pages of this client's
  shared-memory arena that the value then owns; disk values are read by the client from
  their payload files under a read lease, checksum verified; puts go through the arena.
  Other clients use the message path, in chunks of at most ``message_chunk_bytes``.
* **Errors** come back as the same :mod:`persisting.errors` types the store raises.
* **Sessions**: pins and read leases belong to the client's session on each member; the
  client renews it every ``lease_ttl_s / 3`` seconds, so a crashed client's pins expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pulsing

from persisting.config import PersistingSettings
from persisting.errors import (
    ConfigError,
    InvalidKeyError,
    PersistingError,
    ProtocolError,
    ServiceUnavailableError,
    SessionExpiredError,
    StorageIOError,
)
from persisting.kv import Layout, PutResult, TokenHasher
from persisting.kv.keys import ChunkKey, key_string
from persisting.kv.layout import (
    checksum,
    decode_value,
    encode_value,
    writable_bytes,
)
from persisting.service.local_channel import LocalChannel
from persisting.service.protocol import make_request, safe_loads, unwrap_reply
from persisting.service.routing import Membership, group_by_owner, rank_members
from persisting.service.same_host import ClientArena, Region, read_file_into
from persisting.shm import (
    SharedPoolReader,
    aligned_buffer,
    copy_bytes,
    pid_alive,
    round_to_page,
    shm_available,
)

if TYPE_CHECKING:
    from persisting.service.sync_client import SyncKVCacheClient

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: Pulsing's refusal to open one more connection to a peer (the ask was not sent).
_POOL_EXHAUSTED = "Connection pool exhausted"

#: Remembered pool places per member (about 100 bytes each).
_MAX_SPOTS = 1 << 16
#: Hits served from remembered places that are reported in one ``touch`` when no other
#: request is going out to carry them.
_TOUCH_BATCH = 256

#: Failures of the transport (not of the request): the member is treated as gone.
_TRANSPORT_ERRORS = (RuntimeError, OSError, asyncio.TimeoutError, pulsing.PulsingError)


class _MemberFailed(Exception):
    """A member could not be reached or did not answer in time."""

    def __init__(self, member: str, cause: BaseException):
        super().__init__(f"{member}: {type(cause).__name__}: {cause}")
        self.member = member


@dataclass
class _Member:
    """One storage node as this client sees it: its actors, session and data path."""

    addr: str
    node_id: int
    refs: list[Any]
    semaphore: asyncio.Semaphore
    sid: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    shm: bool = False
    direct: bool = False
    channel: LocalChannel | None = None
    pool: SharedPoolReader | None = None
    #: Where memory-tier values lie in ``pool``, as last reported: key -> (layout, offset,
    #: generation). A hit here needs no request; the generation check proves it current.
    spots: OrderedDict[str, tuple[Layout, int, int]] = field(default_factory=OrderedDict)
    #: Keys read through ``spots`` that the server has not been told of yet (recency).
    touched: list[str] = field(default_factory=list)
    #: The pool was unmapped when the member failed; map it again when it answers.
    remap_pool: bool = False
    pending_release: list[str] = field(default_factory=list)
    lane: itertools.count = field(default_factory=itertools.count)
    hello_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def next_ref(self) -> Any:
        return self.refs[next(self.lane) % len(self.refs)]


class KVCacheClient:
    """Asynchronous client of the KV-cache service (see the module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        model: str,
        settings: PersistingSettings,
        same_host: bool = True,
        owns_system: bool = False,
    ):
        self.name = name
        self.model = model
        self.settings = settings
        service = settings.service
        self.max_inflight = service.max_inflight
        self.timeout_s = service.request_timeout_s
        self.chunk_bytes = service.message_chunk_bytes
        self.membership = Membership(retry_s=service.member_retry_s)
        self.counters: Counter[str] = Counter()
        self._same_host = same_host
        self._owns_system = owns_system
        self._members: dict[str, _Member] = {}
        self._arena: ClientArena | None = None
        self._arena_tried = False
        self._largest_value = 0
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-client-read")
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False
        self._system: Any = None

    # -- connecting ---------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        seeds: Sequence[str] | None = None,
        name: str | None = None,
        model: str | None = None,
        *,
        passphrase: str | None = None,
        settings: PersistingSettings | None = None,
        same_host: bool = True,
        min_members: int = 1,
    ) -> KVCacheClient:
        """Join the cluster (unless Pulsing is already initialised) and find the servers.

        ``same_host=False`` forces the message path even on the server's host.
        """
        settings = settings or PersistingSettings()
        service = settings.service
        name = name or service.name
        if model is None:
            if not settings.models:
                raise ConfigError("connect needs model= (or settings.models)")
            model = settings.models[0]
        owns = False
        if not pulsing.is_initialized():
            seed_list = list(seeds) if seeds is not None else list(service.seeds)
            await pulsing.init(
                addr=None,
                seeds=seed_list or None,
                passphrase=passphrase if passphrase is not None else service.passphrase,
            )
            owns = True
        client = cls(
            name=name, model=model, settings=settings, same_host=same_host, owns_system=owns
        )
        client._system = pulsing.get_system()
        try:
            await client._discover(min_members=min_members, wait_s=service.discovery_timeout_s)
        except BaseException:
            await client.close()
            raise
        client._tasks.append(asyncio.create_task(client._keepalive()))
        return client

    async def _discover(self, min_members: int = 0, wait_s: float = 0.0) -> None:
        """Learn the members registered under ``name``; wait for ``min_members`` of them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            found = await self._instances()
            for addr, node_id in found.items():
                known = self._members.get(addr)
                if known is None or known.node_id != node_id:  # new, or restarted
                    with contextlib.suppress(_MemberFailed, PersistingError):
                        await self._attach(addr, node_id)
                        self.membership.mark_up(addr)
            live = [a for a in found if a in self._members]
            self.membership.update(live)
            if len(live) >= min_members:
                return
            if loop.time() >= deadline:
                raise ServiceUnavailableError(
                    f"found {len(live)} {self.name!r} server(s) serving {self.model!r}; "
                    f"wanted {min_members} (is the server up, and the passphrase right?)"
                )
            await asyncio.sleep(0.2)

    async def _instances(self) -> dict[str, int]:
        try:
            instances = await self._system.get_named_instances(self.name)
        except _TRANSPORT_ERRORS:
            return {}
        return {
            str(i["addr"]): int(i["node_id"])
            for i in instances
            if str(i.get("status", "Alive")) == "Alive" and i.get("addr")
        }

    async def _attach(self, addr: str, node_id: int) -> None:
        try:
            ref = await self._system.resolve_named(self.name, node_id=node_id)
        except _TRANSPORT_ERRORS as exc:
            raise _MemberFailed(addr, exc) from exc
        member = _Member(
            addr=addr, node_id=node_id, refs=[ref], semaphore=asyncio.Semaphore(self.max_inflight)
        )
        previous = self._members.get(addr)
        if previous is not None and previous.channel is not None:  # it restarted
            await previous.channel.close()
            previous.channel = None
        await self._hello(member)
        if self.model not in member.info.get("models", ()):
            raise ServiceUnavailableError(f"{addr} does not serve {self.model!r}")
        lanes = []
        for lane in member.info.get("lanes", ()):
            with contextlib.suppress(*_TRANSPORT_ERRORS):
                lanes.append(await self._system.resolve_named(lane, node_id=node_id, timeout=2.0))
        if lanes:
            member.refs = lanes
        self._members[addr] = member
        self.membership.add(addr)

    async def _hello(self, member: _Member) -> None:
        client_info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
        arena = self._get_arena()
        if arena is not None:
            client_info["arena"] = {
                "path": str(arena.path),
                "size": arena.size,
                "nonce": arena.nonce,
            }
        reply = await self._ask(member, make_request("hello", model=self.model, client=client_info))
        info = unwrap_reply(reply)
        member.info = info
        member.sid = info["sid"]
        member.shm = bool(info.get("shm")) and arena is not None
        member.direct = member.shm
        member.semaphore = asyncio.Semaphore(
            min(self.max_inflight, int(info.get("max_inflight", 16)))
        )
        self.chunk_bytes = min(self.chunk_bytes, int(info.get("chunk_bytes", self.chunk_bytes)))
        if member.channel is not None:
            await member.channel.close()
            member.channel = None
        self._map_pool(member, info.get("pool"))
        if member.shm and info.get("local_channel"):
            try:
                member.channel = await LocalChannel.open(str(info["local_channel"]))
            except OSError:
                member.channel = None  # e.g. another mount namespace: stay on Pulsing

    def _map_pool(self, member: _Member, pool: Any) -> None:
        """Map the member's shared memory pool (its memory tier) read-only, if it has one."""
        self._forget_pool(member)
        member.remap_pool = False
        if not member.shm or not isinstance(pool, dict):
            return
        try:
            member.pool = SharedPoolReader(str(pool["path"]), int(pool["size"]))
        except (StorageIOError, KeyError, TypeError, ValueError):
            member.pool = None  # e.g. another mount namespace: the arena path still works

    @staticmethod
    def _forget_pool(member: _Member) -> None:
        """Unmap the member's pool and forget every place in it (it failed, or restarted)."""
        if member.pool is not None:
            member.pool.close()
            member.pool = None
        member.spots.clear()
        member.touched.clear()

    def _server_gone(self, member: _Member) -> bool:
        """True when the member is a process on this host that no longer exists.

        Remembered places are read without asking, so a server killed meanwhile would go
        unnoticed until the next keepalive; checking its pid (one syscall) keeps its keys
        the misses they should be, and frees its pool's memory here at once.
        """
        pid = member.info.get("node", {}).get("pid")
        return isinstance(pid, int) and not pid_alive(pid)

    def _get_arena(self) -> ClientArena | None:
        if self._arena_tried:
            return self._arena
        self._arena_tried = True
        size = self.settings.service.shm_arena_bytes
        if self._same_host and size > 0 and shm_available():
            try:
                self._arena = ClientArena(size)
            except OSError:
                self._arena = None
        return self._arena

    async def _keepalive(self) -> None:
        """Renew every session well inside its TTL, probe members that failed, and pick up
        new or restarted members."""
        ttl = min(
            (float(m.info.get("lease_ttl_s", 30.0)) for m in self._members.values()), default=30.0
        )
        period = max(0.2, min(ttl / 3.0, self.membership.retry_s))
        while not self._closed:
            await asyncio.sleep(period)
            with contextlib.suppress(Exception):
                await self._discover()
            for addr in self.membership.probes_due():  # a success brings a member back
                with contextlib.suppress(_MemberFailed, PersistingError):
                    await self._call(self._members[addr], "renew")
            for member in list(self._members.values()):
                if not self.membership.is_live(member.addr):
                    continue
                try:
                    await self._call(member, "renew")
                except _MemberFailed as exc:
                    self._failed(exc)
                except PersistingError:
                    pass

    async def close(self) -> None:
        """Say goodbye to every member (their sessions end now) and stop background work."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for member in list(self._members.values()):
            if member.sid is None or not self.membership.is_live(member.addr):
                continue
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call(member, "bye"), timeout=2.0)
        for member in self._members.values():
            if member.channel is not None:
                await member.channel.close()
            if member.pool is not None:
                member.pool.close()
        self._readers.shutdown(wait=False)
        if self._arena is not None:
            self._arena.close()
        if self._owns_system:
            with contextlib.suppress(Exception):
                await pulsing.shutdown()

    async def __aenter__(self) -> KVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests -----------------------------------------------------------------------

    async def _ask(self, member: _Member, message: dict[str, Any]) -> Any:
        """Send one message; a transport failure raises _MemberFailed.

        Pulsing 0.1.2 refuses an ask outright ("Connection pool exhausted") when too many
        connections to a peer are being opened at once -- from a cold start about 12, even
        below its pool of 16. Such an ask was never sent, so it is retried after a pause
        instead of being taken for a dead member.
        """
        channel = member.channel
        if channel is not None and message.get("op") != "hello":
            try:
                return await _with_timeout(channel.ask(message), self.timeout_s)
            except (ServiceUnavailableError, *_TRANSPORT_ERRORS) as exc:
                raise _MemberFailed(member.addr, exc) from exc
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        pause = 0.002
        while True:
            ref = member.next_ref()
            try:
                reply = await _with_timeout(ref.ask(message), self.timeout_s)
                break
            except _TRANSPORT_ERRORS as exc:
                if _POOL_EXHAUSTED in str(exc) and asyncio.get_running_loop().time() < deadline:
                    self.counters["pool_exhausted_retries"] += 1
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 0.1)
                    continue
                raise _MemberFailed(member.addr, exc) from exc
        payload = getattr(reply, "payload", None)
        if payload is not None and not isinstance(reply, dict):
            return safe_loads(payload)
        return reply

    async def _call(self, member: _Member, op: str, **args: Any) -> Any:
        """One request to one member: flow-controlled, with a transparent re-hello when the
        server lost our session (it restarted or we were silent past the TTL)."""
        for attempt in range(2):
            async with member.semaphore:
                if member.pending_release and op != "hello":
                    args["release"], member.pending_release = member.pending_release, []
                if member.touched and op != "hello":
                    args["touch"], member.touched = member.touched, []
                message = make_request(op, sid=member.sid, model=self.model, **args)
                reply = await self._ask(member, message)
            try:
                result = unwrap_reply(reply)
            except SessionExpiredError:
                if attempt:
                    raise
                args.pop("release", None)  # leases of a lost session are gone already
                async with member.hello_lock:
                    if member.sid == message["sid"]:
                        await self._hello(member)
                if op in ("renew", "bye"):
                    return None
                continue
            self.membership.mark_up(member.addr)
            if member.remap_pool and op != "bye":  # back after a failure
                member.remap_pool = False
                self._map_pool(member, member.info.get("pool"))
            return result
        raise ProtocolError("unreachable")  # pragma: no cover

    def _live_members(self) -> list[str]:
        return [m for m in self.membership.live if m in self._members]

    def _key(self, key: object) -> str:
        """The key's string form, checked to be a key of this client's model."""
        text = key_string(key)  # validates strings; ChunkKeys are valid by construction
        model = key.model if isinstance(key, ChunkKey) else text.split("@", 1)[0]
        if model != self.model:
            raise InvalidKeyError(f"key of model {model!r} used with a client of {self.model!r}")
        return text

    def _failed(self, exc: _MemberFailed) -> None:
        self.counters["member_failures"] += 1
        self.membership.mark_down(exc.member)
        member = self._members.get(exc.member)
        if member is not None and member.pool is not None:
            self._forget_pool(member)
            member.remap_pool = True  # once it answers again
        logger.warning(
            "kv service member %s failed; left out until a probe (every %.1fs) reaches it: %s",
            exc.member,
            self.membership.retry_s,
            exc,
        )

    async def _on_owners(
        self,
        keys: list[str],
        fn: Callable[[_Member, list[int]], Awaitable[None]],
        on_lost: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Run ``fn(member, indices)`` for each owner's share of ``keys``, concurrently.

        A member that fails is marked down and its share placed again over the members
        still live (where a key lives while its owner is away). Keys no live member could
        take go to ``on_lost`` (reads: misses), or raise ServiceUnavailableError.
        """
        live = self._live_members()
        if len(live) == 1 and keys:  # the common single-server case: no fan-out machinery
            failed = await self._run_share(self._members[live[0]], list(range(len(keys))), fn)
            if not failed:
                return
        pending = list(range(len(keys)))
        for _ in range(len(self._members) + 1):
            live = self._live_members()
            if not pending or not live:
                break
            groups = group_by_owner([keys[i] for i in pending], live)
            jobs = [(member, [pending[j] for j in idx]) for member, idx in groups.items()]
            outcomes = await asyncio.gather(
                *(self._run_share(self._members[m], share, fn) for m, share in jobs)
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
        member: _Member,
        share: list[int],
        fn: Callable[[_Member, list[int]], Awaitable[None]],
    ) -> list[int]:
        try:
            await fn(member, share)
        except _MemberFailed as exc:
            self._failed(exc)
            return share
        return []

    # -- puts -----------------------------------------------------------------------------

    async def put(
        self, key: Any, value: Any, fmt: str = "KV_2LTD", parent: Any = None
    ) -> PutResult:
        """Store one value on its owner; see :meth:`batched_put`."""
        return (
            await self.batched_put(
                [key], [value], fmt=fmt, parents=None if parent is None else [parent]
            )
        )[0]

    async def batched_put(
        self,
        keys: Sequence[Any],
        values: Sequence[Any],
        fmt: str = "KV_2LTD",
        parents: Sequence[Any] | None = None,
    ) -> list[PutResult]:
        """Store values on their owners (one commit per owner and batch).

        A value goes to the next member in its key's ranking when its owner is down;
        ServiceUnavailableError only when no member at all takes it.
        """
        if len(keys) != len(values) or (parents is not None and len(parents) != len(keys)):
            raise PersistingError("keys, values and parents must have the same length")
        texts = [self._key(k) for k in keys]
        parent_texts = [
            None if p is None else key_string(p) for p in (parents or [None] * len(keys))
        ]
        encoded = [encode_value(v, fmt) for v in values]  # validates before any network
        results: list[PutResult | None] = [None] * len(texts)

        async def put_share(member: _Member, share: list[int]) -> None:
            for part in _batches(share, [encoded[i][0].nbytes for i in share], self._batch_bytes()):
                stored = await self._put_items(
                    member,
                    [(texts[i], encoded[i][0], encoded[i][1], parent_texts[i]) for i in part],
                    fmt,
                )
                for i, r in zip(part, stored, strict=True):
                    results[i] = r

        await self._on_owners(texts, put_share)
        return [r for r in results if r is not None]

    def _batch_bytes(self) -> int:
        arena = self._arena
        return max(self.chunk_bytes, (arena.size // 4) if arena is not None else 0)

    async def _put_items(
        self,
        member: _Member,
        items: list[tuple[str, Layout, memoryview, str | None]],
        fmt: str,
    ) -> list[PutResult]:
        regions: list[Region] = []
        wire: list[dict[str, Any]] = []
        try:
            for key, layout, data, parent in items:
                item: dict[str, Any] = {"key": key, "layout": layout.to_dict(), "parent": parent}
                region = self._arena.allocate(layout.nbytes) if member.shm and self._arena else None
                if region is not None:
                    regions.append(region)
                    await self._copy(self._arena.region_view(region), data)  # type: ignore[union-attr]
                    item["source"] = {"shm": region.offset}
                    self.counters["put_bytes_shm"] += layout.nbytes
                else:
                    item["checksum"] = checksum(data)
                    item["source"] = await self._upload(member, data)
                    self.counters["put_bytes_message"] += layout.nbytes
                wire.append(item)
            reply = await self._call(member, "put", items=wire, fmt=fmt)
        finally:
            for region in regions:
                self._arena.free(region)  # type: ignore[union-attr]
        return [PutResult(**r) for r in reply]

    async def _copy(self, dst: memoryview, src: memoryview) -> None:
        if len(src) >= (1 << 20):
            await asyncio.get_running_loop().run_in_executor(self._readers, _copy_into, dst, src)
        else:
            _copy_into(dst, src)

    async def _upload(self, member: _Member, data: memoryview) -> dict[str, Any]:
        if len(data) <= self.chunk_bytes:
            return {"inline": bytes(data)}
        upload = await self._call(member, "upload_begin", nbytes=len(data))
        await asyncio.gather(
            *(
                self._call(
                    member,
                    "upload_part",
                    upload=upload,
                    offset=off,
                    data=bytes(data[off : off + self.chunk_bytes]),
                )
                for off in range(0, len(data), self.chunk_bytes)
            )
        )
        return {"upload": upload}

    # -- gets -----------------------------------------------------------------------------

    async def get(self, key: Any, expect: Layout | None = None) -> Any:
        """The value stored under ``key`` (the kind it was put as), or None on a miss."""
        return (await self.batched_get([key], expect=expect))[0]

    async def batched_get(self, keys: Sequence[Any], expect: Layout | None = None) -> list[Any]:
        """Values of ``keys`` (None for misses, including keys of members that are down)."""
        texts = [self._key(k) for k in keys]
        values: list[Any] = [None] * len(texts)

        async def get_share(member: _Member, share: list[int]) -> None:
            for part in _batches(share, [1] * len(share), 64):
                got = await self._get_values(member, [texts[i] for i in part], expect, None)
                for i, v in zip(part, got, strict=True):
                    if v is not None:  # a retry elsewhere never undoes a hit
                        values[i] = v

        await self._on_owners(texts, get_share, on_lost=self._count_lost)
        return values

    async def get_into(self, key: Any, out: Any, expect: Layout | None = None) -> Layout | None:
        """Copy the payload of ``key`` into ``out`` (a writable buffer of exactly its size)."""
        text = self._key(key)
        target = writable_bytes(out)
        box: list[Layout | None] = [None]

        async def share_fn(member: _Member, share: list[int]) -> None:
            got = await self._get_values(member, [text], expect, [target])
            box[0] = box[0] or got[0]

        await self._on_owners([text], share_fn, on_lost=self._count_lost)
        return box[0]

    def _count_lost(self, indices: list[int]) -> None:
        self.counters["lost_member_misses"] += len(indices)

    async def _get_values(
        self,
        member: _Member,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
    ) -> list[Any]:
        """Values of ``keys`` from one member; with ``outs``, fill them and return layouts.

        Memory-tier values whose place in the member's shared pool is remembered are
        copied out without asking (their generation proves them current); the rest are
        fetched.
        """
        results: list[Any] = [None] * len(keys)
        ask: list[int] = []
        if member.spots and self._server_gone(member):
            self._forget_pool(member)  # the request below then fails: the keys are misses
        for i, key in enumerate(keys):
            value = self._read_remembered(member, key, expect, outs[i] if outs else None)
            if value is None:
                ask.append(i)
            else:
                results[i] = value
        if ask:
            await _fill(
                results, ask, keys, outs, partial(self._fetch_values, member, expect=expect)
            )
        elif len(member.touched) >= _TOUCH_BATCH:
            await self._call(member, "touch", keys=[])  # carries the touches along
        return results

    def _read_remembered(
        self, member: _Member, key: str, expect: Layout | None, out: memoryview | None
    ) -> Any:
        """``key``'s value copied from its remembered place in the pool, or None."""
        spot = member.spots.get(key)
        if spot is None or member.pool is None:
            return None
        layout, offset, generation = spot
        if expect is not None and not layout.matches(expect):
            return None  # the server judges the mismatch
        value = self._read_pooled(member.pool, layout, offset, generation, out)
        if value is _EVICTED:
            member.spots.pop(key, None)
            return None
        member.spots.move_to_end(key)
        member.touched.append(key)
        self.counters["get_hits_remembered"] += 1
        return value

    def _remember(self, member: _Member, key: str, layout: Layout, spot: list[int]) -> None:
        member.spots[key] = (layout, int(spot[0]), int(spot[1]))
        member.spots.move_to_end(key)
        if len(member.spots) > _MAX_SPOTS:
            member.spots.popitem(last=False)

    async def _fetch_values(
        self,
        member: _Member,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
    ) -> list[Any]:
        """Ask one member for ``keys``; with ``outs``, fill them and return layouts.

        On the same-host path, memory-tier values come as places in the server's shared
        pool, which the client copies out itself; without a pool the request offers a
        window of the arena, and values the server copies there are returned without
        another copy (they own their pages until they are dropped). Disk values come as
        file locations the client reads.
        """
        expect_wire = None if expect is None else expect.to_dict()
        window = None
        if outs is None and member.pool is None:
            window = self._window(member, len(keys), expect)
        args: dict[str, Any] = {"keys": keys, "expect": expect_wire, "direct": member.direct}
        if member.pool is not None:
            args["pool"] = True
        if window is not None:
            args["arena"] = [window.offset, window.capacity]
        try:
            entries = await self._call(member, "get", **args)
        except _MemberFailed:
            if window is not None:  # the server may still write there: never reuse it
                self.counters["arena_quarantined_bytes"] += window.capacity
            raise
        except BaseException:
            if window is not None:
                self._arena.free(window)  # type: ignore[union-attr]
            raise
        results: list[Any] = [None] * len(keys)
        located: list[int] = []
        pooled: list[int] = []
        in_memory: list[int] = []
        kept: list[tuple[int, int]] = []
        try:
            for i, entry in enumerate(entries):
                if entry is None:
                    continue
                self._largest_value = max(self._largest_value, int(entry["layout"]["nbytes"]))
                if "shm" in entry:
                    results[i] = self._from_arena(entry)
                    kept.append((entry["shm"], int(entry["layout"]["nbytes"])))
                elif "loc" in entry:
                    located.append(i)
                elif "pool" in entry and member.pool is not None:
                    pooled.append(i)
                elif entry.get("memory"):
                    in_memory.append(i)
                else:
                    results[i] = await self._receive_message(
                        member, entry, outs[i] if outs else None
                    )
        finally:
            if window is not None:
                self._free_unused(window, kept)
        for i in pooled:
            layout = Layout.from_dict(entries[i]["layout"])
            offset, generation = entries[i]["pool"]
            out = outs[i] if outs else None
            value = self._read_pooled(member.pool, layout, offset, generation, out)
            if value is _EVICTED:
                in_memory.append(i)
            else:
                results[i] = value
                self._remember(member, keys[i], layout, entries[i]["pool"])
        if located:
            inline = len(located) == 1
            read = await asyncio.gather(
                *(
                    self._read_located(entries[i], outs[i] if outs else None, inline)
                    for i in located
                )
            )
            member.pending_release.extend(keys[i] for i in located)
            for i, value in zip(located, read, strict=True):
                if value is _EVICTED:
                    in_memory.append(i)
                else:
                    results[i] = value
        if in_memory:
            fetch = partial(self._get_via_arena, member, expect=expect)
            await _fill(results, in_memory, keys, outs, fetch)
        return results

    def _window(self, member: _Member, count: int, expect: Layout | None) -> Region | None:
        """Arena room for ``count`` values (sized from ``expect`` or the largest seen)."""
        if not member.shm or self._arena is None:
            return None
        each = expect.nbytes if expect is not None else (self._largest_value or _FIRST_GUESS)
        want = min(count * round_to_page(each), self._arena.size // 4)
        return self._arena.allocate(want)

    def _from_arena(self, entry: dict[str, Any]) -> Any:
        layout = Layout.from_dict(entry["layout"])
        self.counters["get_bytes_shm"] += layout.nbytes
        return decode_value(layout, self._arena.hand_out(entry["shm"], layout.nbytes))  # type: ignore[union-attr]

    def _free_unused(self, window: Region, kept: list[tuple[int, int]]) -> None:
        """Give back the parts of ``window`` that no returned value lives in."""
        assert self._arena is not None
        cursor = window.offset
        for offset, nbytes in sorted(kept):
            self._arena.free_range(cursor, offset - cursor)
            cursor = offset + round_to_page(max(nbytes, 1))
        self._arena.free_range(cursor, window.offset + window.capacity - cursor)

    async def _read_located(
        self, entry: dict[str, Any], out: memoryview | None, inline: bool = False
    ) -> Any:
        """Read a leased payload file ourselves and verify its checksum.

        The bytes land in ``out``, else in arena pages (already mapped: no page faults, and
        the value owns them until it is dropped), else in a fresh buffer.
        """
        layout = Layout.from_dict(entry["layout"])
        path, offset, nbytes, digest = entry["loc"]
        target, region, buffer = self._destination(nbytes, out)
        try:
            if inline:  # a lone read is faster without the thread hop
                ok = _read_and_verify(path, offset, target, digest)
            else:  # several reads: spread them over threads (and cores)
                ok = await asyncio.get_running_loop().run_in_executor(
                    self._readers, _read_and_verify, path, offset, target, digest
                )
        except (FileNotFoundError, StorageIOError):
            ok = None
        if not ok:
            if region is not None:
                self._arena.free(region)  # type: ignore[union-attr]
            if ok is None:
                return _EVICTED  # gone before we opened it: ask the server again
            self.counters["checksum_misses"] += 1
            return None
        self.counters["get_bytes_direct"] += nbytes
        return self._value_in(layout, out, region, buffer)

    def _read_pooled(
        self,
        pool: SharedPoolReader | None,
        layout: Layout,
        offset: int,
        generation: int,
        out: memoryview | None,
    ) -> Any:
        """Copy a memory-tier value out of the server's shared pool; _EVICTED when it was
        freed before or during the copy (then it is asked for again)."""
        target, region, buffer = self._destination(layout.nbytes, out)
        assert pool is not None
        if not pool.read_into(offset, layout.nbytes, generation, np.frombuffer(target, np.uint8)):
            if region is not None:
                self._arena.free(region)  # type: ignore[union-attr]
            self.counters["pool_retries"] += 1
            return _EVICTED
        self.counters["get_bytes_pool"] += layout.nbytes
        return self._value_in(layout, out, region, buffer)

    def _destination(
        self, nbytes: int, out: memoryview | None
    ) -> tuple[memoryview, Region | None, np.ndarray | None]:
        """Where a value read by this client goes: the caller's ``out``, else arena pages
        (already mapped: no page faults, and the value owns them until it is dropped), else
        a fresh buffer. Returns (target, arena region or None, fresh buffer or None)."""
        if out is not None:
            if len(out) != nbytes:
                raise PersistingError(f"get_into needs a buffer of {nbytes} bytes, got {len(out)}")
            return out, None, None
        if self._arena is not None and (region := self._arena.allocate(nbytes)) is not None:
            return self._arena.region_view(region), region, None
        buffer = aligned_buffer(nbytes)
        return memoryview(buffer), None, buffer

    def _value_in(
        self,
        layout: Layout,
        out: memoryview | None,
        region: Region | None,
        buffer: np.ndarray | None,
    ) -> Any:
        """What a get returns once the bytes are in the place :meth:`_destination` chose."""
        if out is not None:
            return layout
        if region is not None:
            return decode_value(layout, self._arena.hand_out(region.offset, layout.nbytes))  # type: ignore[union-attr]
        assert buffer is not None
        return decode_value(layout, buffer)

    async def _get_via_arena(
        self,
        member: _Member,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
    ) -> list[Any]:
        """Values that were not read yet: asked for again with room sized to each one, or
        (no arena, or no room) over the message path."""
        results: list[Any] = [None] * len(keys)
        expect_wire = None if expect is None else expect.to_dict()
        layouts = await self._call(member, "layout", keys=keys)
        for i, (key, wire_layout) in enumerate(zip(keys, layouts, strict=True)):
            if wire_layout is None:
                continue
            out = outs[i] if outs else None
            nbytes = int(wire_layout["nbytes"])
            region = None
            if member.shm and self._arena is not None:
                region = self._arena.allocate(nbytes)
            if region is None:
                entries = await self._call(member, "get", keys=[key], expect=expect_wire)
                if entries[0] is not None:
                    results[i] = await self._receive_message(member, entries[0], out)
                continue
            args = {
                "keys": [key],
                "expect": expect_wire,
                "direct": True,
                "arena": [region.offset, region.capacity],
            }
            try:
                entry = (await self._call(member, "get", **args))[0]
            except _MemberFailed:
                self.counters["arena_quarantined_bytes"] += region.capacity
                raise
            except BaseException:
                self._arena.free(region)
                raise
            if entry is not None and "shm" in entry:
                if out is not None:
                    shared = self._arena.view[entry["shm"] : entry["shm"] + nbytes]
                    await self._copy(out, shared)
                    self._arena.free(region)
                    results[i] = Layout.from_dict(entry["layout"])
                else:
                    results[i] = self._from_arena(entry)
                    self._free_unused(region, [(entry["shm"], nbytes)])
                continue
            self._arena.free(region)
            if entry is None:
                continue
            if "loc" in entry:  # it reached the disk meanwhile
                value = await self._read_located(entry, out)
                member.pending_release.append(key)
                results[i] = None if value is _EVICTED else value
            else:
                results[i] = await self._receive_message(member, entry, out)
        return results

    async def _receive_message(
        self, member: _Member, entry: dict[str, Any], out: memoryview | None
    ) -> Any:
        """A value sent inline or as a transfer read in chunks; verified by its checksum."""
        layout = Layout.from_dict(entry["layout"])
        buffer = aligned_buffer(layout.nbytes)
        if "data" in entry:
            buffer[:] = np.frombuffer(entry["data"], np.uint8)
        else:
            transfer = entry["transfer"]

            async def read(offset: int) -> None:
                length = min(self.chunk_bytes, layout.nbytes - offset)
                data = await self._call(
                    member, "read_part", transfer=transfer, offset=offset, length=length
                )
                buffer[offset : offset + len(data)] = np.frombuffer(data, np.uint8)

            try:
                await asyncio.gather(
                    *(read(off) for off in range(0, layout.nbytes, self.chunk_bytes))
                )
            except PersistingError:
                with contextlib.suppress(Exception):
                    await self._call(member, "end_transfer", transfer=transfer)
                raise
        if checksum(buffer) != entry["checksum"]:
            self.counters["checksum_misses"] += 1
            return None
        self.counters["get_bytes_message"] += layout.nbytes
        if out is not None:
            if len(out) != layout.nbytes:
                raise PersistingError(
                    f"get_into needs a buffer of {layout.nbytes} bytes, got {len(out)}"
                )
            _copy_into(out, memoryview(buffer))
            return layout
        return decode_value(layout, buffer)

    # -- index operations ---------------------------------------------------------------

    async def contains(self, key: Any) -> bool:
        return (await self._presence([self._key(key)]))[0]

    async def _presence(self, keys: list[str]) -> list[bool]:
        found = [False] * len(keys)

        async def ask(member: _Member, share: list[int]) -> None:
            for part in _batches(share, [1] * len(share), 1024):
                flags = await self._call(member, "contains", keys=[keys[i] for i in part])
                for i, flag in zip(part, flags, strict=True):
                    found[i] = found[i] or bool(flag)

        await self._on_owners(keys, ask, on_lost=self._count_lost)
        return found

    async def layout(self, key: Any) -> Layout | None:
        text = self._key(key)
        box: list[Layout | None] = [None]

        async def ask(member: _Member, share: list[int]) -> None:
            got = (await self._call(member, "layout", keys=[text]))[0]
            box[0] = None if got is None else Layout.from_dict(got)

        await self._on_owners([text], ask, on_lost=self._count_lost)
        return box[0]

    async def lookup_prefix(self, keys: Sequence[Any]) -> int:
        """Leading chunks present; with one key list per rank, a chunk counts only when
        every rank's piece is present. Keys on members that are down count as misses."""
        if keys and isinstance(keys[0], list | tuple):
            ranks = [[self._key(k) for k in rank] for rank in keys]
            n = min(len(r) for r in ranks) if ranks else 0
            flat = [rank[i] for i in range(n) for rank in ranks]
            present = await self._presence(flat)
            width = len(ranks)
            for chunk in range(n):
                if not all(present[chunk * width : (chunk + 1) * width]):
                    return chunk
            return n
        texts = [self._key(k) for k in keys]
        if len(self._live_members()) == 1 and texts:
            member = self._members[self._live_members()[0]]
            try:
                return int(await self._call(member, "lookup_prefix", keys=texts))
            except _MemberFailed as exc:
                self._failed(exc)
                return 0
        present = await self._presence(texts)
        for i, flag in enumerate(present):
            if not flag:
                return i
        return len(texts)

    @property
    def chunk_size(self) -> int:
        """The token chunk size the servers hash this model with (from their hello)."""
        for member in self._members.values():
            size = (member.info.get("chunk_sizes") or {}).get(self.model)
            if isinstance(size, int) and size > 0:
                return size
        return self.settings.kv.chunk_size

    async def lookup_tokens(self, tokens: Any, hasher: TokenHasher | None = None) -> int:
        """Leading tokens whose chunks are all stored (hashed with the servers' chunk size
        unless a ``hasher`` is given)."""
        hasher = hasher or TokenHasher(model=self.model, chunk_size=self.chunk_size)
        chunks = hasher.process_tokens(tokens)
        hits = await self.lookup_prefix([key for _s, _e, key in chunks])
        return chunks[hits - 1][1] if hits else 0

    async def remove(self, key: Any, force: bool = True) -> bool:
        return (await self.batched_remove([key], force=force)) > 0

    async def batched_remove(self, keys: Sequence[Any], force: bool = True) -> int:
        """Remove ``keys`` from every live member (a key may linger on a member that held it
        before a failover); returns how many keys were removed somewhere."""
        texts = [self._key(k) for k in keys]
        removed = [False] * len(texts)

        async def on(member: _Member) -> None:
            for text in texts:
                member.spots.pop(text, None)
            try:
                flags = await self._call(member, "remove", keys=texts, force=force)
            except _MemberFailed as exc:
                self._failed(exc)
                return
            for i, flag in enumerate(flags):
                removed[i] = removed[i] or bool(flag)

        await asyncio.gather(*(on(self._members[m]) for m in self._live_members()))
        return sum(removed)

    async def pin(self, key: Any) -> bool:
        """Pin ``key`` on its owner for as long as this client lives (renewed by TTL)."""
        return await self._on_owner_flag("pin", key)

    async def unpin(self, key: Any) -> bool:
        return await self._on_owner_flag("unpin", key)

    async def _on_owner_flag(self, op: str, key: Any) -> bool:
        text = self._key(key)
        box = [False]

        async def ask(member: _Member, share: list[int]) -> None:
            box[0] = bool((await self._call(member, op, keys=[text]))[0])

        await self._on_owners([text], ask, on_lost=self._count_lost)
        return box[0]

    async def prefetch(self, keys: Sequence[Any]) -> int:
        """Load disk hits into the owners' memory tiers; returns how many are in memory."""
        texts = [self._key(k) for k in keys]
        total = [0]

        async def ask(member: _Member, share: list[int]) -> None:
            for part in _batches(share, [1] * len(share), 1024):
                total[0] += int(await self._call(member, "prefetch", keys=[texts[i] for i in part]))

        await self._on_owners(texts, ask, on_lost=self._count_lost)
        return total[0]

    async def stats(self) -> dict[str, Any]:
        """Each live member's store and service counters, plus this client's."""
        members: dict[str, Any] = {}

        async def on(addr: str) -> None:
            try:
                members[addr] = await self._call(self._members[addr], "stats")
            except _MemberFailed as exc:
                self._failed(exc)

        await asyncio.gather(*(on(m) for m in self._live_members()))
        return {
            "model": self.model,
            "members": members,
            "live_members": self._live_members(),
            "known_members": self.membership.known,
            "client": dict(self.counters),
        }

    def member_of(self, key: Any) -> str | None:
        """The live member that owns ``key`` now (None if none is live)."""
        ranking = rank_members(self._key(key), self._live_members())
        return ranking[0] if ranking else None

    @property
    def members(self) -> list[str]:
        return self._live_members()

    def same_host(self, member: str) -> bool:
        """True if this client reads ``member``'s payloads directly (same-host path)."""
        m = self._members.get(member)
        return bool(m and m.direct)

    @staticmethod
    def connect_sync(*args: Any, **kwargs: Any) -> SyncKVCacheClient:
        """:meth:`connect` for code without an event loop (see SyncKVCacheClient)."""
        from persisting.service.sync_client import SyncKVCacheClient

        return SyncKVCacheClient.connect(*args, **kwargs)


# -- helpers ------------------------------------------------------------------------------

_EVICTED = object()

#: Arena room offered per value before the client has seen any value's size.
_FIRST_GUESS = 8 << 20


async def _with_timeout(awaitable: Awaitable[T], timeout_s: float) -> T:
    """Await with a deadline (asyncio.timeout where it exists: no extra task per call)."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout_s)
    async with timeout(timeout_s):
        return await awaitable


async def _fill(
    results: list[Any],
    indices: list[int],
    keys: list[str],
    outs: list[memoryview] | None,
    fetch: Callable[..., Awaitable[list[Any]]],
) -> None:
    """``results[i] = value`` for each ``i`` in ``indices``, fetched in one call as
    ``fetch(keys=..., outs=...)`` for just those keys (and their ``outs``)."""
    got = await fetch(
        keys=[keys[i] for i in indices], outs=[outs[i] for i in indices] if outs else None
    )
    for i, value in zip(indices, got, strict=True):
        results[i] = value


def _batches(indices: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """Split ``indices`` into runs whose ``sizes`` add up to at most ``limit`` (>= 1 each)."""
    out: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, size in zip(indices, sizes, strict=True):
        if current and used + size > limit:
            out.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        out.append(current)
    return out


def _copy_into(dst: memoryview, src: memoryview) -> None:
    copy_bytes(np.frombuffer(dst, np.uint8), src)


def _read_and_verify(path: str, offset: int, out: memoryview, digest: int) -> bool:
    read_file_into(path, offset, out)
    return checksum(out) == digest


__all__ = ["KVCacheClient", "PutResult"]
