"""KVCacheClient: the KV store's API, served by one or more KVCacheStorageActor nodes.

::

    client = await KVCacheClient.connect(seeds=["127.0.0.1:8610"], name="kvstore",
                                         model="meta-llama/Llama-3-8B")
    await client.put(key, tensor)
    tensor = await client.get(key)           # None on a miss
    hit_chunks = await client.lookup_prefix(keys)

The methods are the contract of :mod:`persisting.kv.api`
(:class:`~persisting.kv.api.AsyncKVApi`): those of the local :class:`persisting.kv.KVStore`,
awaited;
:class:`~persisting.service.client.sync.SyncKVCacheClient` offers them without ``await``.
This class is the facade; the work is done by the cluster (members, discovery,
placement), the transport, the reader and the writer of this package.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import warnings
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import pulsing

from persisting.config import PersistingSettings
from persisting.errors import ConfigError, InvalidKeyError, InvalidValueError
from persisting.kv import Layout, PutResult, TokenHasher
from persisting.kv.api import AsyncKVApi, PrefixKeys, Tokens
from persisting.kv.keys import HASH_SCHEMES, ChunkKey, HashScheme, key_string
from persisting.kv.paths.load_plan import HitChunk, LoadPlan, plan_load
from persisting.kv.paths.tiers import KeyLike
from persisting.service.client.cluster import Cluster
from persisting.service.client.link import PutItem
from persisting.service.client.member import Member, MemberFailed
from persisting.service.client.reads import Reader, read_path
from persisting.service.client.writes import Writer
from persisting.service.passphrase import client_passphrase
from persisting.service.routing import rank_members

logger = logging.getLogger("persisting.service.client")


class KVCacheClient(AsyncKVApi):
    """Asynchronous client of the KV-cache service (see the module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        model: str,
        settings: PersistingSettings,
        system: Any,
        same_host: bool = True,
        owns_system: bool = False,
        role: str | None = None,
    ):
        self.name = name
        self.model = model
        self.settings = settings
        self.counters: Counter[str] = Counter()
        self._owns_system = owns_system
        #: Threads that read the payload files a same-host member passes (in a batch).
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-client-read")
        self.cluster = Cluster(
            system,
            name,
            model,
            settings.service,
            self.counters,
            same_host=same_host,
            readers=self._readers,
            role=role,
        )
        self._reader = Reader(
            self.cluster,
            self.counters,
            self._key,
            result_buffer_bytes=settings.kv.result_buffer_bytes,
            network_bytes_per_s=settings.service.network_bytes_per_s,
        )
        self._writer = Writer(self.cluster, self.counters, self._key, self._reader.remember)
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False
        #: The key dtype token lookups hash with by default (see KVStore.key_dtype).
        self.key_dtype: Any = settings.kv.key_dtype

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
        role: str | None = None,
    ) -> KVCacheClient:
        """Join the cluster (unless Pulsing is already initialised) and find the servers.

        The passphrase is ``passphrase``, else ``settings.service.passphrase``, else the
        one a server on this host generated (:mod:`persisting.service.passphrase`). When
        this process already runs Pulsing, its system is used as it is: ``seeds`` and
        ``passphrase`` cannot change it, and passing them then is warned about
        (``RuntimeWarning`` and the log), never silently dropped.
        ``same_host=False`` makes a client on a server's host use its TCP port, as a
        client on another host does, instead of its Unix socket and shared pool. ``role``
        tells the members what the client is (``"copies"``: a member sending copies). A server
        that answers but serves another model is an AccessDeniedError at once.
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
            secret = client_passphrase(passphrase, service)
            await pulsing.init(addr=None, seeds=seed_list or None, passphrase=secret)
            owns = True
        else:
            _warn_unhonoured(seeds, passphrase)
        client = cls(
            name=name,
            model=model,
            settings=settings,
            system=pulsing.get_system(),
            same_host=same_host,
            owns_system=owns,
            role=role,
        )
        try:
            wait_s = service.discovery_timeout_s
            await client.cluster.discover(min_members=min_members, wait_s=wait_s, settle=True)
        except BaseException:
            await client.close()
            raise
        client._tasks.append(asyncio.create_task(client._keepalive()))
        return client

    async def _keepalive(self) -> None:
        """Renew every session well inside its TTL, probe members that failed, and pick
        up new or restarted members."""
        while not self._closed:
            await asyncio.sleep(self.cluster.keepalive_period())
            await self.cluster.keepalive_round()

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
        await self.cluster.close()
        self._readers.shutdown(wait=True)
        # Drop what holds Pulsing objects while the interpreter is whole: Pulsing's threads
        # releasing them during finalization can crash the process (entry 2 of
        # persisting.pulsing_compat).
        for member in self.cluster.members.values():
            member.ref = None
        self.cluster.members.clear()
        self.cluster.system = None
        if self._owns_system:
            with contextlib.suppress(Exception):
                await pulsing.shutdown()
            gc.collect()

    async def __aenter__(self) -> KVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _key(self, key: KeyLike) -> str:
        """The key's string form, checked to be a key of this client's model."""
        text = key_string(key)  # validates strings; ChunkKeys are valid by construction
        model = key.model if isinstance(key, ChunkKey) else text.split("@", 1)[0]
        if model != self.model:
            raise InvalidKeyError(f"key of model {model!r} used with a client of {self.model!r}")
        return text

    # -- values -------------------------------------------------------------------------

    async def put(
        self,
        key: KeyLike,
        value: Any,
        fmt: str = "KV_2LTD",
        parent: KeyLike | None = None,
        *,
        check_shape: bool = True,
    ) -> PutResult:
        """Store one value on its owner; see :meth:`batched_put`."""
        parents = None if parent is None else [parent]
        return (
            await self._writer.batched_put(
                [key], [value], fmt=fmt, parents=parents, check_shape=check_shape
            )
        )[0]

    async def batched_put(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        fmt: str = "KV_2LTD",
        parents: Sequence[KeyLike | None] | None = None,
        *,
        check_shape: bool = True,
    ) -> list[PutResult]:
        """Store values on their owners (one commit per owner and batch).
        ``check_shape=False``, as in-process: the format's shape rule and the key's dtype
        are not checked, on either side (layouts another system owns, e.g. LMCache's)."""
        return await self._writer.batched_put(
            keys, values, fmt=fmt, parents=parents, check_shape=check_shape
        )

    async def get(self, key: KeyLike, expect: Layout | None = None) -> Any:
        """The value stored under ``key`` (the kind it was put as), or None on a miss."""
        return (await self._reader.batched_get([key], expect=expect))[0]

    async def batched_get(self, keys: Sequence[KeyLike], expect: Layout | None = None) -> list[Any]:
        """Values of ``keys`` (None for misses, including keys of members that are down)."""
        return await self._reader.batched_get(keys, expect=expect)

    async def get_into(self, key: KeyLike, out: Any, expect: Layout | None = None) -> Layout | None:
        """Copy the payload of ``key`` into ``out`` (a writable buffer of exactly its size)."""
        return await self._reader.get_into(key, out, expect=expect)

    async def batched_get_into(
        self, keys: Sequence[KeyLike], outs: Sequence[Any], expect: Layout | None = None
    ) -> list[Layout | None]:
        """:meth:`get_into` for a batch: one request per owner (not one per key); the
        layout per key read, None per miss. Not part of the KV API contract."""
        return await self._reader.batched_get_into(keys, outs, expect=expect)

    # -- index operations ---------------------------------------------------------------

    async def contains(self, key: KeyLike) -> bool:
        return (await self._presence([self._key(key)]))[0]

    async def batched_contains(self, keys: Sequence[KeyLike]) -> list[bool]:
        """One flag per key; each owner is asked once per 1,024 keys."""
        return await self._presence([self._key(k) for k in keys])

    async def _presence(self, keys: list[str]) -> list[bool]:
        found = [False] * len(keys)

        async def ask(member: Member, share: list[int]) -> None:
            for start in range(0, len(share), 1024):
                part = share[start : start + 1024]
                flags = await self.cluster.call(member, "contains", keys=[keys[i] for i in part])
                for i, flag in zip(part, flags, strict=True):
                    found[i] = found[i] or bool(flag)

        await self.cluster.on_copies(
            keys, ask, lambda i: found[i], on_lost=self._reader.count_lost, together=True
        )
        return found

    async def layout(self, key: KeyLike) -> Layout | None:
        text = self._key(key)
        box: list[Layout | None] = [None]

        async def ask(member: Member, _share: list[int]) -> None:
            got = (await self.cluster.call(member, "layout", keys=[text]))[0]
            box[0] = None if got is None else Layout.from_dict(got)

        await self.cluster.on_copies(
            [text], ask, lambda _i: box[0] is not None, on_lost=self._reader.count_lost
        )
        return box[0]

    async def lookup_prefix(self, keys: PrefixKeys) -> int:
        """Leading chunks present; with one key list per rank, a chunk counts only when
        every rank's piece is present. Keys on members that are down count as misses."""
        if keys and isinstance(keys[0], list | tuple):
            ranks = [[self._key(k) for k in cast(Sequence[KeyLike], rank)] for rank in keys]
            n = min(len(r) for r in ranks) if ranks else 0
            flat = [rank[i] for i in range(n) for rank in ranks]
            present = await self._presence(flat)
            width = len(ranks)
            for chunk in range(n):
                if not all(present[chunk * width : (chunk + 1) * width]):
                    return chunk
            return n
        texts = [self._key(cast(KeyLike, k)) for k in keys]
        single = self._single_member()
        if single is not None and texts:
            try:
                return int(await self.cluster.call(single, "lookup_prefix", keys=texts))
            except MemberFailed as exc:
                self.cluster.failed(exc)
                return 0
        present = await self._presence(texts)
        for i, flag in enumerate(present):
            if not flag:
                return i
        return len(texts)

    def _single_member(self) -> Member | None:
        live = self.cluster.live()
        return self.cluster.members[live[0]] if len(live) == 1 else None

    @property
    def chunk_size(self) -> int:
        """The token chunk size the servers hash this model with (from their hello)."""
        for member in self.cluster.members.values():
            size = (member.info.get("chunk_sizes") or {}).get(self.model)
            if isinstance(size, int) and size > 0:
                return size
        return self.settings.kv.chunk_size

    @property
    def hash_scheme(self) -> HashScheme:
        """How the servers hash this model's token ids (from their hello, else the
        client's own ``kv.hash_scheme``)."""
        for member in self.cluster.members.values():
            scheme = (member.info.get("hash_schemes") or {}).get(self.model)
            if scheme in HASH_SCHEMES:
                return cast(HashScheme, scheme)
        return self.settings.kv.hash_scheme

    async def lookup_tokens(self, tokens: Any, hasher: TokenHasher | None = None) -> int:
        """Leading tokens whose chunks are all stored (hashed with the servers' chunk size
        and hash scheme unless a ``hasher`` is given).

        Hit tokens are counted where the lookup happens: with one server, the server hashes
        and looks up (one request), so its store counts them
        (``persisting_kv_hit_tokens_total``) as for an in-process lookup; with several, no
        server sees the whole prefix, so this client hashes, asks each owner about its
        chunks and counts them itself (``stats()["client"]["lookup_hit_tokens"]``).
        """
        hasher = hasher or TokenHasher(
            model=self.model,
            chunk_size=self.chunk_size,
            scheme=self.hash_scheme,
            dtype=self.key_dtype,
        )
        single = self._single_member()
        wire = None
        if single is not None:
            wire = _hasher_settings(hasher, self.model, "hash_schemes" in single.info)
        if single is not None and wire is not None:
            ids = _token_ids(tokens)
            try:
                return int(
                    await self.cluster.call(single, "lookup_tokens", tokens=ids, hasher=wire)
                )
            except MemberFailed as exc:
                self.cluster.failed(exc)
                return 0
        chunks = hasher.process_tokens(tokens)
        hits = await self.lookup_prefix([key for _s, _e, key in chunks])
        hit_tokens = chunks[hits - 1][1] if hits else 0
        self.counters["lookup_tokens"] += 1
        self.counters["lookup_hit_tokens"] += hit_tokens
        return hit_tokens

    async def plan_tokens(
        self,
        tokens: Tokens,
        *,
        recompute_tokens_per_s: float,
        hasher: TokenHasher | None = None,
        min_saving_s: float = 0.0,
    ) -> LoadPlan:
        """Load or recompute, as :meth:`KVStore.plan_tokens <persisting.kv.KVStore.plan_tokens>`
        does in-process: of the stored prefix of ``tokens``, the leading part worth loading
        at a prefill rate of ``recompute_tokens_per_s``.

        Each hit chunk is priced at the bandwidth this client's own reads achieved lately
        over the path a read of it takes now (``reads.read_path``: a server on another
        host: the network; same host: the shared pool or the Unix socket), so a remote hit
        slower than recomputing is not loaded. A path not read yet is priced at
        ``service.network_bytes_per_s`` for another host if set, else counts as free (the
        first reads measure it). Asks each member holding copies once per 1,024 chunks where
        they are.
        """
        hasher = hasher or TokenHasher(
            model=self.model, chunk_size=self.chunk_size, scheme=self.hash_scheme
        )
        chunks = hasher.process_tokens(tokens)
        texts = [self._key(k) for _s, _e, k in chunks]
        where: list[tuple[str, int] | None] = [None] * len(texts)

        async def ask(member: Member, share: list[int]) -> None:
            for start in range(0, len(share), 1024):
                part = share[start : start + 1024]
                found = await self.cluster.call(member, "tiers", keys=[texts[i] for i in part])
                for i, entry in zip(part, found, strict=True):
                    if entry is not None and where[i] is None:
                        where[i] = (read_path(member, str(entry[0])), int(entry[1]))

        await self.cluster.on_copies(
            texts, ask, lambda i: where[i] is not None, self._reader.count_lost, together=True
        )
        hits: list[HitChunk] = []
        for (start, end, _key), found in zip(chunks, where, strict=True):
            if found is None:  # the prefix ends at the first miss
                break
            hits.append(HitChunk(found[0], end - start, found[1]))
        return plan_load(
            hits, recompute_tokens_per_s, self._reader.bandwidth, min_saving_s=min_saving_s
        )

    async def remove(self, key: KeyLike, force: bool = True) -> bool:
        return (await self.batched_remove([key], force=force)) > 0

    async def batched_remove(self, keys: Sequence[KeyLike], force: bool = True) -> int:
        """Remove ``keys`` from every live member (a key may linger on a member that held it
        before a failover); returns how many keys were removed somewhere."""
        texts = [self._key(k) for k in keys]
        removed = [False] * len(texts)

        async def on(member: Member) -> None:
            for text in texts:
                member.locations.pop(text, None)
            try:
                flags = await self.cluster.call(member, "remove", keys=texts, force=force)
            except MemberFailed as exc:
                self.cluster.failed(exc)
                return
            for i, flag in enumerate(flags):
                removed[i] = removed[i] or bool(flag)

        await asyncio.gather(*(on(self.cluster.members[m]) for m in self.cluster.live()))
        return sum(removed)

    async def pin(self, key: KeyLike) -> bool:
        """Pin ``key`` on its owner for as long as this client lives (renewed by TTL)."""
        return await self._on_owner_flag("pin", key)

    async def unpin(self, key: KeyLike) -> bool:
        return await self._on_owner_flag("unpin", key)

    async def _on_owner_flag(self, op: str, key: KeyLike) -> bool:
        text = self._key(key)
        box = [False]

        async def ask(member: Member, _share: list[int]) -> None:
            box[0] = bool((await self.cluster.call(member, op, keys=[text]))[0])

        await self.cluster.on_owners([text], ask, on_lost=self._reader.count_lost)
        return box[0]

    async def prefetch(self, keys: Sequence[KeyLike]) -> int:
        """Load disk hits into the owners' memory tiers; returns how many are in memory."""
        texts = [self._key(k) for k in keys]
        total = [0]

        async def ask(member: Member, share: list[int]) -> None:
            for start in range(0, len(share), 1024):
                part = [texts[i] for i in share[start : start + 1024]]
                total[0] += int(await self.cluster.call(member, "prefetch", keys=part))

        await self.cluster.on_owners(texts, ask, on_lost=self._reader.count_lost)
        return total[0]

    async def stats(self) -> dict[str, Any]:
        """Each live member's store and service counters, plus this client's."""
        members: dict[str, Any] = {}

        async def on(addr: str) -> None:
            try:
                members[addr] = await self.cluster.call(self.cluster.members[addr], "stats")
            except MemberFailed as exc:
                self.cluster.failed(exc)

        await asyncio.gather(*(on(m) for m in self.cluster.live()))
        return {
            "model": self.model,
            "members": members,
            "live_members": self.cluster.live(),
            "known_members": self.cluster.membership.known,
            "client": dict(self.counters),
        }

    # -- one member's copies (a member's replicator sends them) ----------------------------

    async def contains_on(self, addr: str, keys: Sequence[KeyLike]) -> list[bool]:
        """Which of ``keys`` the member at ``addr`` holds (MemberFailed if it fails)."""
        member = self.cluster.members[addr]
        texts = [self._key(k) for k in keys]
        flags: list[bool] = []
        for start in range(0, len(texts), 1024):
            part = texts[start : start + 1024]
            flags.extend(bool(f) for f in await self.cluster.call(member, "contains", keys=part))
        return flags

    async def put_on(
        self, addr: str, keys: Sequence[KeyLike], payloads: Sequence[Any], layouts: Sequence[Layout]
    ) -> list[PutResult]:
        """Store payloads already laid out (``layouts``, as the member that holds them
        stored them) on the member at ``addr``, whatever the key's ranking says."""
        items: list[PutItem] = [
            (self._key(k), layout, memoryview(p).cast("B"), None)
            for k, p, layout in zip(keys, payloads, layouts, strict=True)
        ]
        return await self._writer.put_on(self.cluster.members[addr], items)

    def member_of(self, key: KeyLike) -> str | None:
        """The live member that owns ``key`` now (None if none is live)."""
        ranking = rank_members(self._key(key), self.cluster.live())
        return ranking[0] if ranking else None

    @property
    def members(self) -> list[str]:
        return self.cluster.live()

    def same_host(self, member: str) -> bool:
        """True if this client reaches ``member`` over its Unix socket (same host)."""
        m = self.cluster.members.get(member)
        return bool(m and m.same_host)


def _warn_unhonoured(seeds: Sequence[str] | None, passphrase: str | None) -> None:
    """Say loudly that ``seeds`` and ``passphrase`` cannot be honoured: Pulsing is already
    running in this process, joined and keyed as whoever started it chose."""
    ignored = [name for name, given in (("seeds", seeds), ("passphrase", passphrase)) if given]
    if not ignored:
        return
    message = (
        f"KVCacheClient.connect: Pulsing is already initialised in this process, so "
        f"{' and '.join(ignored)} cannot be applied: the running system's own are used "
        "(connect before anything else starts Pulsing, or leave them out)"
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _token_ids(tokens: Any) -> list[int]:
    try:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidValueError(f"tokens must be 64-bit integers: {exc}") from exc
    return [int(t) for t in ids.tolist()]


def _hasher_settings(hasher: TokenHasher, model: str, schemes_known: bool) -> dict[str, Any] | None:
    """``hasher``'s settings for a server to rebuild it, or None when it cannot be rebuilt
    from them (another model, or tags): then the client hashes itself.

    The scheme is always sent to a server that knows schemes (``schemes_known``: its hello
    lists them; its own default may be either), and to an older one only when it is not
    Persisting's, which such a server refuses rather than hashing wrongly."""
    if type(hasher) is not TokenHasher or hasher.model != model:
        return None
    settings: dict[str, Any] = {
        "chunk_size": hasher.chunk_size,
        "world_size": hasher.world_size,
        "worker_id": hasher.worker_id,
        "dtype": hasher.dtype,
        "save_unfull_chunk": hasher.save_unfull_chunk,
    }
    if schemes_known or hasher.scheme != "persisting":
        settings["hash_scheme"] = hasher.scheme
    probe = [0] * hasher.chunk_size  # tags are not among the settings: compare one key
    rebuilt = {k: v for k, v in settings.items() if k != "hash_scheme"}
    server_side = TokenHasher(model, **rebuilt, scheme=hasher.scheme)
    if server_side.process_tokens(probe) != hasher.process_tokens(probe):
        return None
    return settings


__all__ = ["KVCacheClient", "PutResult"]
