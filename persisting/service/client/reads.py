"""A client's reads: ``get``, ``batched_get`` and ``get_into`` over the members.

A member on another host with a data port is read over data connections
(:mod:`~persisting.service.client.bulk`): one request per connection, a batch spread over
several, each value received straight into its destination. Otherwise, per member, a
batch of keys is read in at most two asks:

1. keys whose pool location is remembered are copied out without asking (the generation
   check proves the location current); locations are learned from gets, from our own
   puts, and from the placements of other clients' puts that a get's reply tells;
2. the rest are asked for once (:meth:`Reader._first_ask`); each typed reply entry
   (:mod:`~persisting.service.client.replies`) becomes a source
   (:mod:`~persisting.service.client.sources`) whose ``read`` fetches the value;
3. values that moved meanwhile, or are in memory where the client cannot copy them
   itself, are asked for once more with a window of the arena sized to them, or, without
   room, over messages (:meth:`Reader._ask_with_room`). A value still not found is a miss.

Every read is timed into :attr:`Reader.bandwidth`, per path, for load-or-recompute plans.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from persisting.errors import PersistingError
from persisting.kv import Layout, SharedLocation
from persisting.kv.layout import writable_bytes
from persisting.kv.load_plan import TierBandwidth
from persisting.kv.tiers import KeyLike
from persisting.service.client.bulk import BulkLink, BulkRead, spread
from persisting.service.client.cluster import Cluster
from persisting.service.client.member import Member
from persisting.service.client.regions import ArenaLoans
from persisting.service.client.replies import Entry, GetReply, Told, parse_get_reply
from persisting.service.client.sources import (
    AGAIN,
    ArenaWindow,
    LeasedFile,
    Message,
    PoolCopy,
    ReadContext,
    Source,
    source_of,
)
from persisting.service.same_host import ClientArena, Region
from persisting.shm import RecycledBuffers, round_to_page

#: Remembered pool locations per member (about 100 bytes each).
MAX_LOCATIONS = 1 << 16
#: Hits served from remembered locations that are reported in one ``touch`` when no other
#: request is going out to carry them.
TOUCH_BATCH = 256
#: Arena room offered per value before the client has seen any value's size.
FIRST_GUESS = 8 << 20
#: Keys asked for in one ``get``.
GET_BATCH = 64

#: The name each read path's bandwidth is kept under (:attr:`Reader.bandwidth`).
PATH_OF_SOURCE: dict[type, str] = {
    PoolCopy: "pool",
    ArenaWindow: "arena",
    LeasedFile: "file",
    Message: "message",
}


def bulk_path(tier: str) -> str:
    """The bandwidth name of a data-connection read of a value from the server's ``tier``."""
    return f"bulk:{tier}"


class Reader:
    """Reads values for a :class:`~persisting.service.client.KVCacheClient`."""

    def __init__(
        self,
        cluster: Cluster,
        arena: ClientArena | None,
        loans: ArenaLoans | None,
        counters: Counter[str],
        key_of: Callable[[KeyLike], str],
        result_buffer_bytes: int = 256 << 20,
        network_bytes_per_s: int | None = None,
    ):
        self.cluster = cluster
        self.arena = arena
        self.loans = loans
        self.counters = counters
        self._key = key_of
        #: Pages values read by this client are returned in (as the in-process store does).
        self.results = RecycledBuffers(result_buffer_bytes) if result_buffer_bytes > 0 else None
        #: Bandwidth each read path achieved lately (``pool``, ``file``, ``arena``,
        #: ``message``, ``bulk:memory``, ``bulk:disk``), for load-or-recompute plans; the
        #: paths to another host start from ``network_bytes_per_s`` when it is given.
        remote = ("message", bulk_path("memory"), bulk_path("disk"))
        prior = {path: float(network_bytes_per_s) for path in remote} if network_bytes_per_s else {}
        self.bandwidth = TierBandwidth(initial=prior)
        self._largest_value = 0
        self.readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-client-read")

    async def batched_get(self, keys: Sequence[KeyLike], expect: Layout | None = None) -> list[Any]:
        """Values of ``keys`` (None for misses, including keys of members that are down)."""
        texts = [self._key(k) for k in keys]
        values: list[Any] = [None] * len(texts)

        async def get_share(member: Member, share: list[int]) -> None:
            for start in range(0, len(share), GET_BATCH):
                part = share[start : start + GET_BATCH]
                got: list[Any] = [None] * len(part)
                try:
                    await self.from_member(member, [texts[i] for i in part], expect, None, got)
                finally:  # what was read before a failure is kept
                    for i, value in zip(part, got, strict=True):
                        if value is not None:  # a retry elsewhere never undoes a hit
                            values[i] = value

        await self.cluster.on_owners(texts, get_share, on_lost=self.count_lost)
        return values

    async def get_into(self, key: KeyLike, out: Any, expect: Layout | None = None) -> Layout | None:
        """Copy the payload of ``key`` into ``out`` (a writable buffer of exactly its size)."""
        text = self._key(key)
        target = writable_bytes(out)
        box: list[Any] = [None]

        async def share_fn(member: Member, _share: list[int]) -> None:
            got: list[Any] = [None]
            await self.from_member(member, [text], expect, [target], got)
            box[0] = box[0] or got[0]

        await self.cluster.on_owners([text], share_fn, on_lost=self.count_lost)
        return box[0]

    def path_of(self, member: Member, tier: str) -> str:
        """The read path (its :attr:`bandwidth` name) a value in ``member``'s ``tier``
        ("memory" or "disk") takes now."""
        if member.bulk is not None and not member.same_host:
            return bulk_path(tier)
        if not member.same_host:
            return "message"
        if tier == "disk":
            return "file"
        return "pool" if member.pool is not None else "arena"

    def count_lost(self, indices: list[int]) -> None:
        self.counters["lost_member_misses"] += len(indices)

    def close(self) -> None:
        self.readers.shutdown(wait=False)

    # -- one member -----------------------------------------------------------------------

    async def from_member(
        self,
        member: Member,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
    ) -> None:
        """Fill ``results`` with the values of ``keys`` from one member (with ``outs``: fill
        those and put the layouts in ``results``); None stays for a miss."""
        if member.bulk is not None and not member.same_host:
            await self._from_bulk(member, keys, expect, outs, results)
            return
        ctx = self._context(member)
        if member.locations and member.process_gone():
            self.cluster.forget_pool(member)  # the request below then fails: misses
        asking = [
            i for i in range(len(keys)) if not self._remembered(ctx, keys, i, expect, outs, results)
        ]
        if not asking:
            if len(member.touched) >= TOUCH_BATCH:
                await self.cluster.call(member, "touch", keys=[])  # carries the touches
            return
        again = await self._first_ask(ctx, keys, asking, expect, outs, results)
        if again:
            await self._ask_with_room(ctx, keys, again, expect, outs, results)

    def _context(self, member: Member) -> ReadContext:
        return ReadContext(
            member,
            self.arena,
            self.results,
            self.counters,
            self.readers,
            self.cluster.call,
            self.cluster.message_part_bytes,
        )

    def _remembered(
        self,
        ctx: ReadContext,
        keys: list[str],
        i: int,
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
    ) -> bool:
        """Read ``keys[i]`` from its remembered pool location; False if it must be asked."""
        member = ctx.member
        location = member.locations.get(keys[i])
        if location is None or member.pool is None:
            return False
        if expect is not None and not location.layout.matches(expect):
            return False  # the server judges the mismatch
        value = PoolCopy(location).read_now(ctx, outs[i] if outs else None)
        if value is AGAIN:
            member.locations.pop(keys[i], None)
            return False
        member.locations.move_to_end(keys[i])
        member.touched.append(keys[i])
        self.counters["get_hits_remembered"] += 1
        results[i] = value
        return True

    def remember(self, member: Member, key: str, location: SharedLocation) -> None:
        """Keep where ``key``'s value lies in ``member``'s pool (from a get or a put)."""
        member.locations[key] = location
        member.locations.move_to_end(key)
        if len(member.locations) > MAX_LOCATIONS:
            member.locations.popitem(last=False)

    # -- the two asks -----------------------------------------------------------------------

    async def _first_ask(
        self,
        ctx: ReadContext,
        keys: list[str],
        indices: list[int],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
    ) -> dict[int, int]:
        """Ask for ``keys[indices]`` once; fills ``results``, and returns the indices to
        ask for again (the value moved, or needs room) with their values' sizes."""
        member = ctx.member
        pooled = member.pool is not None
        args = self._get_args(member, keys, indices, expect)
        if pooled:
            args["pool"] = True
            args["learn"] = True  # and where other clients' values were placed lately
        window = self._first_window(member, indices, expect, outs)
        reply = await self._send_get(member, args, window, len(indices))
        self._learn(member, reply.told)
        return await self._read_entries(
            ctx, keys, indices, reply.entries, outs, results, window, pooled, first=True
        )

    async def _ask_with_room(
        self,
        ctx: ReadContext,
        keys: list[str],
        sizes: dict[int, int],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
    ) -> None:
        """Ask once more for the values of ``sizes`` (index -> size), offering arena room of
        those sizes, or, with none free, over messages. Whatever is not read now is a miss."""
        member = ctx.member
        indices = list(sizes)
        args = self._get_args(member, keys, indices, expect)
        window = self._room(member, sizes)
        if member.same_host and window is None:
            args["direct"] = False  # no room in the arena: over messages
        reply = await self._send_get(member, args, window, len(indices))
        await self._read_entries(
            ctx, keys, indices, reply.entries, outs, results, window, False, first=False
        )

    @staticmethod
    def _get_args(
        member: Member, keys: list[str], indices: list[int], expect: Layout | None
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"keys": [keys[i] for i in indices], "direct": member.same_host}
        if expect is not None:
            args["expect"] = expect.to_dict()
        return args

    async def _send_get(
        self, member: Member, args: dict[str, Any], window: Region | None, count: int
    ) -> GetReply:
        """One ``get`` to ``member`` (lending ``window`` for its duration), its reply typed."""
        if window is None:
            return parse_get_reply(await self.cluster.call(member, "get", **args), count)
        assert self.loans is not None and self.arena is not None
        args["arena"] = [window.offset, window.capacity]
        try:
            raw = await self.loans.lend(member, [window], "get", **args)
            return parse_get_reply(raw, count)
        except PersistingError:  # answered: the server is done with the window
            self.arena.free(window)
            raise

    async def _read_entries(
        self,
        ctx: ReadContext,
        keys: list[str],
        indices: list[int],
        entries: list[Entry | None],
        outs: list[memoryview] | None,
        results: list[Any],
        window: Region | None,
        pooled: bool,
        *,
        first: bool,
    ) -> dict[int, int]:
        """Read what ``entries`` name into ``results``; after the ``first`` ask, the indices
        of values that moved or need room, with their sizes (after the second: misses)."""
        again: dict[int, int] = {}
        kept: list[tuple[int, int]] = []  # window pages handed out with values
        files: list[tuple[int, LeasedFile]] = []
        try:
            for i, entry in zip(indices, entries, strict=True):
                if entry is None:
                    continue
                nbytes = entry.layout.nbytes
                self._largest_value = max(self._largest_value, nbytes)
                source = source_of(entry, pooled)
                if source is None:
                    self._needs_room(again, i, nbytes, first)
                elif isinstance(source, LeasedFile):
                    files.append((i, source))
                else:
                    value = await self._timed_read(source, ctx, outs[i] if outs else None, nbytes)
                    if value is AGAIN:
                        self._needs_room(again, i, nbytes, first)
                        continue
                    results[i] = value
                    if isinstance(source, PoolCopy):
                        self.remember(ctx.member, keys[i], source.location)
                    elif isinstance(source, ArenaWindow) and outs is None:
                        kept.append((source.offset, nbytes))
        finally:
            if window is not None:
                self._free_unused(window, kept)
        if files:
            for _i, f in files:
                f.spread = len(files) > 1
            read = await asyncio.gather(
                *(self._timed_read(f, ctx, outs[i] if outs else None, f.nbytes) for i, f in files)
            )
            ctx.member.pending_release.extend(keys[i] for i, _f in files)
            for (i, f), value in zip(files, read, strict=True):
                if value is AGAIN:
                    self._needs_room(again, i, f.nbytes, first)
                else:
                    results[i] = value
        return again

    async def _timed_read(
        self, source: Source, ctx: ReadContext, out: memoryview | None, nbytes: int
    ) -> Any:
        start = time.perf_counter()
        value = await source.read(ctx, out)
        if value is not AGAIN and value is not None:
            path = PATH_OF_SOURCE.get(type(source), "other")
            self.bandwidth.record(path, nbytes, time.perf_counter() - start)
        return value

    def _learn(self, member: Member, told: list[Told]) -> None:
        """Remember the placements the server told, while there is room: a told place is
        a hint, so it never pushes out a location this client used (and keys already
        remembered keep theirs: a location from our own put or get is at least as new)."""
        if member.pool is None or not told:
            return
        locations = member.locations
        learned = 0
        for placement in told:
            if len(locations) >= MAX_LOCATIONS:
                break
            if placement.key not in locations:
                locations[placement.key] = placement.location
                learned += 1
        self.counters["placements_learned"] += learned

    @staticmethod
    def _needs_room(again: dict[int, int], i: int, nbytes: int, first: bool) -> None:
        if first:  # after the second ask it is a miss
            again[i] = nbytes

    # -- arena room -------------------------------------------------------------------------

    def _first_window(
        self,
        member: Member,
        indices: list[int],
        expect: Layout | None,
        outs: list[memoryview] | None,
    ) -> Region | None:
        """Room for the server to copy memory-tier values into on the first ask: only when
        there is no pool to copy from ourselves and no caller's buffer (sized from
        ``expect`` or the largest value seen)."""
        arena = self.arena
        if not member.same_host or arena is None or self.loans is None:
            return None
        if member.pool is not None or outs:
            return None
        each = expect.nbytes if expect is not None else (self._largest_value or FIRST_GUESS)
        return arena.allocate(min(len(indices) * round_to_page(each), arena.size // 4))

    def _room(self, member: Member, sizes: dict[int, int]) -> Region | None:
        """Room of exactly ``sizes`` for the second ask (None: none, or no arena)."""
        arena = self.arena
        if not member.same_host or arena is None or self.loans is None:
            return None
        return arena.allocate(sum(round_to_page(n) for n in sizes.values()))

    def _free_unused(self, window: Region, kept: list[tuple[int, int]]) -> None:
        """Give back the parts of ``window`` that no returned value lives in."""
        arena = self.arena
        assert arena is not None
        cursor = window.offset
        for offset, nbytes in sorted(kept):
            arena.free_range(cursor, offset - cursor)
            cursor = offset + round_to_page(max(nbytes, 1))
        arena.free_range(cursor, window.offset + window.capacity - cursor)

    # -- the bulk data path -------------------------------------------------------------------

    async def _from_bulk(
        self,
        member: Member,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
    ) -> None:
        """Read ``keys`` over data connections, spread over the member's streams at once."""
        assert member.bulk is not None
        runs = spread(len(keys), member.bulk.streams)
        if len(runs) == 1:  # one connection: no task to spread over
            await self._bulk_run(member, keys, list(runs[0]), expect, outs, results)
            return
        outcomes = await asyncio.gather(
            *(self._bulk_run(member, keys, list(run), expect, outs, results) for run in runs),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _bulk_run(
        self,
        member: Member,
        keys: list[str],
        indices: list[int],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
    ) -> None:
        """One request on one data connection (the failure rules:
        :meth:`Cluster.over_data_path`)."""
        names = [keys[i] for i in indices]
        targets = [outs[i] for i in indices] if outs else None

        def get(link: BulkLink) -> Awaitable[list[BulkRead | None]]:
            return link.get(self.cluster.model, names, expect, targets, self.results)

        reads = await self.cluster.over_data_path(member, get)
        self._take_bulk(indices, reads, results)

    def _take_bulk(
        self, indices: list[int], reads: list[BulkRead | None], results: list[Any]
    ) -> None:
        for i, read in zip(indices, reads, strict=True):
            if read is None:
                continue
            if read.value is None:
                self.counters["checksum_misses"] += 1
                continue
            results[i] = read.value
            self.counters["get_bytes_bulk"] += read.nbytes
            self.bandwidth.record(bulk_path(read.tier), read.nbytes, read.seconds)


__all__ = ["GET_BATCH", "PATH_OF_SOURCE", "Reader", "bulk_path"]
