"""A client's reads: ``get``, ``batched_get`` and ``get_into`` over the members.

Per member, a batch of keys is read in at most two asks:

1. keys whose pool location is remembered are copied out without asking (the generation
   check proves the location current); locations are learned from gets, from our own
   puts, and from the placements of other clients' puts that a get's reply tells;
2. the rest are asked for once; each reply entry becomes a source
   (:mod:`~persisting.service.client.sources`) that reads the value;
3. values that moved meanwhile, or are in memory where the client cannot copy them
   itself, are asked for once more with a window of the arena sized to them (or, without
   room, over messages). A value still not found is a miss.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from persisting.errors import PersistingError
from persisting.kv import Layout, SharedLocation
from persisting.kv.layout import writable_bytes
from persisting.service.client.cluster import Cluster
from persisting.service.client.member import Member
from persisting.service.client.regions import ArenaLoans
from persisting.service.client.sources import (
    AGAIN,
    ArenaWindow,
    LeasedFile,
    PoolCopy,
    ReadContext,
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


class Reader:
    """Reads values for a :class:`~persisting.service.client.KVCacheClient`."""

    def __init__(
        self,
        cluster: Cluster,
        arena: ClientArena | None,
        loans: ArenaLoans | None,
        counters: Counter[str],
        key_of: Any,
        result_buffer_bytes: int = 256 << 20,
    ):
        self.cluster = cluster
        self.arena = arena
        self.loans = loans
        self.counters = counters
        self._key = key_of
        #: Pages values read by this client are returned in (as the in-process store does).
        self.results = RecycledBuffers(result_buffer_bytes) if result_buffer_bytes > 0 else None
        self._largest_value = 0
        self.readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-client-read")

    async def batched_get(self, keys: Sequence[Any], expect: Layout | None = None) -> list[Any]:
        """Values of ``keys`` (None for misses, including keys of members that are down)."""
        texts = [self._key(k) for k in keys]
        values: list[Any] = [None] * len(texts)

        async def get_share(member: Member, share: list[int]) -> None:
            for start in range(0, len(share), GET_BATCH):
                part = share[start : start + GET_BATCH]
                got = await self.from_member(member, [texts[i] for i in part], expect, None)
                for i, value in zip(part, got, strict=True):
                    if value is not None:  # a retry elsewhere never undoes a hit
                        values[i] = value

        await self.cluster.on_owners(texts, get_share, on_lost=self.count_lost)
        return values

    async def get_into(self, key: Any, out: Any, expect: Layout | None = None) -> Layout | None:
        """Copy the payload of ``key`` into ``out`` (a writable buffer of exactly its size)."""
        text = self._key(key)
        target = writable_bytes(out)
        box: list[Layout | None] = [None]

        async def share_fn(member: Member, _share: list[int]) -> None:
            got = await self.from_member(member, [text], expect, [target])
            box[0] = box[0] or got[0]

        await self.cluster.on_owners([text], share_fn, on_lost=self.count_lost)
        return box[0]

    def count_lost(self, indices: list[int]) -> None:
        self.counters["lost_member_misses"] += len(indices)

    def close(self) -> None:
        self.readers.shutdown(wait=False)

    # -- one member -----------------------------------------------------------------------

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

    async def from_member(
        self,
        member: Member,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
    ) -> list[Any]:
        """Values of ``keys`` from one member; with ``outs``, fill them and return layouts."""
        ctx = self._context(member)
        results: list[Any] = [None] * len(keys)
        if member.locations and member.process_gone():
            self.cluster.forget_pool(member)  # the request below then fails: misses
        asking = [
            i for i in range(len(keys)) if not self._remembered(ctx, keys, i, expect, outs, results)
        ]
        if not asking:
            if len(member.touched) >= TOUCH_BATCH:
                await self.cluster.call(member, "touch", keys=[])  # carries the touches
            return results
        again = await self._ask(ctx, keys, asking, expect, outs, results)
        if again:
            await self._ask(ctx, keys, list(again), expect, outs, results, sizes=again)
        return results

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
        value = PoolCopy(location).read(ctx, outs[i] if outs else None)
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

    async def _ask(
        self,
        ctx: ReadContext,
        keys: list[str],
        indices: list[int],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
        sizes: dict[int, int] | None = None,
    ) -> dict[int, int]:
        """One ``get`` for ``keys[indices]``; fills ``results``. The first ask (no
        ``sizes``) returns the indices to ask again, with their values' sizes; the second
        offers room of those sizes and returns nothing."""
        member = ctx.member
        first = sizes is None
        args: dict[str, Any] = {"keys": [keys[i] for i in indices], "direct": member.same_host}
        if expect is not None:
            args["expect"] = expect.to_dict()
        pooled = first and member.pool is not None
        if pooled:
            args["pool"] = True
            args["learn"] = True  # and where other clients' values were placed lately
        window = self._window(member, indices, expect, outs, sizes)
        if member.same_host and not first and window is None:
            args["direct"] = False  # no room in the arena: over messages
        if window is not None:
            assert self.loans is not None
            args["arena"] = [window.offset, window.capacity]
            try:
                entries = await self.loans.lend(member, [window], "get", **args)
            except PersistingError:
                self.arena.free(window)  # type: ignore[union-attr]
                raise
        else:
            entries = await self.cluster.call(member, "get", **args)
        if isinstance(entries, dict):  # a reply to ``learn``
            self._learn(member, entries)
            entries = entries["entries"]
        again: dict[int, int] = {}
        kept: list[tuple[int, int]] = []
        files: list[tuple[int, LeasedFile]] = []
        try:
            for i, entry in zip(indices, entries, strict=True):
                if entry is None:
                    continue
                nbytes = int(entry["layout"]["nbytes"])
                self._largest_value = max(self._largest_value, nbytes)
                out = outs[i] if outs else None
                source = source_of(entry, pooled)
                if source is None:
                    self._needs_room(again, i, nbytes, first)
                elif isinstance(source, ArenaWindow):
                    results[i] = source.read(ctx, out)
                    if out is None:
                        kept.append((source.offset, nbytes))
                elif isinstance(source, PoolCopy):
                    value = source.read(ctx, out)
                    if value is AGAIN:
                        self._needs_room(again, i, nbytes, first)
                    else:
                        results[i] = value
                        self.remember(member, keys[i], source.location)
                elif isinstance(source, LeasedFile):
                    files.append((i, source))
                else:
                    results[i] = await source.read(ctx, out)
        finally:
            if window is not None:
                self._free_unused(window, kept)
        if files:
            read = await asyncio.gather(
                *(f.read(ctx, outs[i] if outs else None, len(files) == 1) for i, f in files)
            )
            member.pending_release.extend(keys[i] for i, _f in files)
            for (i, f), value in zip(files, read, strict=True):
                if value is AGAIN:
                    self._needs_room(again, i, f.nbytes, first)
                else:
                    results[i] = value
        return again

    def _learn(self, member: Member, reply: dict[str, Any]) -> None:
        """Remember the placements the server told, while there is room: a told place is
        a hint, so it never pushes out a location this client used (and keys already
        remembered keep theirs: a location from our own put or get is at least as new)."""
        if member.pool is None or not reply.get("told"):
            return
        layouts = [Layout.from_dict(d) for d in reply["layouts"]]
        locations = member.locations
        learned = 0
        for key, index, offset, generation in reply["told"]:
            if len(locations) >= MAX_LOCATIONS:
                break
            if key not in locations:
                locations[key] = SharedLocation(layouts[index], offset, generation)
                learned += 1
        self.counters["placements_learned"] += learned

    @staticmethod
    def _needs_room(again: dict[int, int], i: int, nbytes: int, first: bool) -> None:
        if first:  # after the second ask it is a miss
            again[i] = nbytes

    def _window(
        self,
        member: Member,
        indices: list[int],
        expect: Layout | None,
        outs: list[memoryview] | None,
        sizes: dict[int, int] | None,
    ) -> Region | None:
        """Arena room for the server to copy memory-tier values into: on the first ask
        only when there is no pool to copy from ourselves and no caller's buffer (sized
        from ``expect`` or the largest value seen); on the second, sized to ``sizes``."""
        arena = self.arena
        if not member.same_host or arena is None or self.loans is None:
            return None
        if sizes is not None:
            return arena.allocate(sum(round_to_page(n) for n in sizes.values()))
        if member.pool is not None or outs:
            return None
        each = expect.nbytes if expect is not None else (self._largest_value or FIRST_GUESS)
        return arena.allocate(min(len(indices) * round_to_page(each), arena.size // 4))

    def _free_unused(self, window: Region, kept: list[tuple[int, int]]) -> None:
        """Give back the parts of ``window`` that no returned value lives in."""
        arena = self.arena
        assert arena is not None
        cursor = window.offset
        for offset, nbytes in sorted(kept):
            arena.free_range(cursor, offset - cursor)
            cursor = offset + round_to_page(max(nbytes, 1))
        arena.free_range(cursor, window.offset + window.capacity - cursor)


__all__ = ["Reader"]
