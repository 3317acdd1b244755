"""A client's reads: ``get``, ``batched_get`` and ``get_into`` over the members.

A value is read one way per transport (docs/architecture.md has the table):

* **over a data connection** (:mod:`.link`; TCP to another host, the Unix socket on the
  member's host): a batch is spread over the member's connections, each value received
  straight into its destination (on the Unix socket a value on disk comes as its open
  payload file, read here);
* **out of the member's shared pool** (same host, its memory tier): a value whose place in
  the pool the client knows is copied out without asking, the generation check proving
  the place current. Places are learned from our puts, from gets (asked ``pool``, the
  member says where a value lies instead of sending it) and from the placements other
  clients' puts made, which those gets' replies tell. A place gone stale (the value was
  evicted or moved) is asked for again, over the connection.

Every read is timed into :attr:`Reader.bandwidth`, per path, for load-or-recompute plans.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from persisting.errors import InvalidValueError
from persisting.kv import Layout, SharedLocation
from persisting.kv.layout import writable_bytes
from persisting.kv.paths.load_plan import TierBandwidth
from persisting.kv.paths.tiers import KeyLike
from persisting.service.client.cluster import Cluster
from persisting.service.client.destination import Destination
from persisting.service.client.link import DataLink, GetReply, Read, spread
from persisting.service.client.member import Member
from persisting.shm import RecycledBuffers

#: Remembered pool locations per member (about 100 bytes each).
MAX_LOCATIONS = 1 << 16
#: Hits served from remembered locations that are reported in one ``touch`` when no other
#: request is going out to carry them.
TOUCH_BATCH = 256
#: Keys asked for in one ``get``.
GET_BATCH = 64


def read_path(member: Member, tier: str) -> str:
    """The bandwidth name of a read of a value in ``member``'s ``tier`` ("memory" or
    "disk") now: ``pool``, ``local:<tier>`` (Unix socket) or ``remote:<tier>`` (TCP)."""
    if tier == "memory" and member.pool is not None:
        return "pool"
    return f"{'local' if member.same_host else 'remote'}:{tier}"


class Reader:
    """Reads values for a :class:`~persisting.service.client.KVCacheClient`."""

    def __init__(
        self,
        cluster: Cluster,
        counters: Counter[str],
        key_of: Callable[[KeyLike], str],
        result_buffer_bytes: int = 256 << 20,
        network_bytes_per_s: int | None = None,
    ):
        self.cluster = cluster
        self.counters = counters
        self._key = key_of
        #: Pages values read by this client are returned in (as the in-process store does),
        #: without huge pages: a caller that keeps its values uses each range once, and a
        #: fresh huge page costs far more to fault in than 4 KiB pages where the host has
        #: taken freed memory back (:func:`persisting.shm.aligned_buffer` says why).
        self.results = (
            RecycledBuffers(result_buffer_bytes, huge_pages=False)
            if result_buffer_bytes > 0
            else None
        )
        #: Bandwidth each read path achieved lately (:func:`read_path`), for
        #: load-or-recompute plans; the paths to another host start from
        #: ``network_bytes_per_s`` when it is given.
        remote = ("remote:memory", "remote:disk")
        prior = {path: float(network_bytes_per_s) for path in remote} if network_bytes_per_s else {}
        self.bandwidth = TierBandwidth(initial=prior)

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

        await self.cluster.on_copies(
            texts, get_share, lambda i: values[i] is not None, on_lost=self.count_lost
        )
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

        await self.cluster.on_copies(
            [text], share_fn, lambda _i: box[0] is not None, on_lost=self.count_lost
        )
        return box[0]

    async def batched_get_into(
        self, keys: Sequence[KeyLike], outs: Sequence[Any], expect: Layout | None = None
    ) -> list[Layout | None]:
        """:meth:`get_into` for a batch: each owner is asked once for its share (in pieces
        of :data:`GET_BATCH` keys); every destination is checked before anything is asked.
        A miss, or a key of a member that is down, leaves None."""
        texts = [self._key(k) for k in keys]
        if len(outs) != len(texts):
            raise InvalidValueError(f"{len(texts)} keys but {len(outs)} destinations")
        targets = [writable_bytes(out) for out in outs]
        layouts: list[Layout | None] = [None] * len(texts)

        async def get_share(member: Member, share: list[int]) -> None:
            for start in range(0, len(share), GET_BATCH):
                part = share[start : start + GET_BATCH]
                got: list[Any] = [None] * len(part)
                try:
                    await self.from_member(
                        member, [texts[i] for i in part], expect, [targets[i] for i in part], got
                    )
                finally:
                    for i, value in zip(part, got, strict=True):
                        if value is not None:
                            layouts[i] = value

        await self.cluster.on_copies(
            texts, get_share, lambda i: layouts[i] is not None, on_lost=self.count_lost
        )
        return layouts

    def count_lost(self, indices: list[int]) -> None:
        self.counters["lost_member_misses"] += len(indices)

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
        if member.locations and member.process_gone():
            self.cluster.forget_pool(member)  # the request below then fails: misses
        asking = [
            i
            for i in range(len(keys))
            if not self._remembered(member, keys, i, expect, outs, results)
        ]
        if not asking:
            if len(member.touched) >= TOUCH_BATCH:
                await self.cluster.call(member, "touch", keys=[])  # carries the touches
            return
        again = await self._ask(
            member, keys, asking, expect, outs, results, member.pool is not None
        )
        if again:  # gone from where the pool said: sent this time
            await self._ask(member, keys, again, expect, outs, results, False)

    def _remembered(
        self,
        member: Member,
        keys: list[str],
        i: int,
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
    ) -> bool:
        """Read ``keys[i]`` from its remembered pool location; False if it must be asked."""
        location = member.locations.get(keys[i])
        if location is None or member.pool is None:
            return False
        if expect is not None and not location.layout.matches(expect):
            return False  # the server judges the mismatch
        value = self._copy_out(member, location, outs[i] if outs else None)
        if value is None:
            member.locations.pop(keys[i], None)
            return False
        member.locations.move_to_end(keys[i])
        member.touched.append(keys[i])
        self.counters["get_hits_remembered"] += 1
        results[i] = value
        return True

    def _copy_out(self, member: Member, location: SharedLocation, out: memoryview | None) -> Any:
        """The value at ``location`` of the member's pool, copied out (None: it moved)."""
        pool = member.pool
        if pool is None:
            return None
        nbytes = location.layout.nbytes
        start = time.perf_counter()
        dest = Destination(self.results, nbytes, out)
        target = np.frombuffer(dest.target, np.uint8)
        if not pool.read_into(location.offset, nbytes, location.generation, target):
            dest.discard()  # freed before or during the copy
            self.counters["pool_retries"] += 1
            return None
        self.counters["get_bytes_pool"] += nbytes
        self.bandwidth.record("pool", nbytes, time.perf_counter() - start)
        return dest.value(location.layout)

    def remember(self, member: Member, key: str, location: SharedLocation) -> None:
        """Keep where ``key``'s value lies in ``member``'s pool (from a get or a put)."""
        member.locations[key] = location
        member.locations.move_to_end(key)
        if len(member.locations) > MAX_LOCATIONS:
            member.locations.popitem(last=False)

    async def _ask(
        self,
        member: Member,
        keys: list[str],
        indices: list[int],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: list[Any],
        pool: bool,
    ) -> list[int]:
        """Get ``keys[indices]`` over the member's data connections, spread over them; the
        indices whose pool place went stale before they were copied out."""
        link = member.link
        runs = spread(len(indices), link.streams if link is not None else 1)
        stale: list[int] = []

        async def run(part: list[int]) -> None:
            def get(link: DataLink) -> Awaitable[GetReply]:
                targets = [outs[i] for i in part] if outs else None
                names = [keys[i] for i in part]
                return link.get(self.cluster.model, names, expect, targets, self.results, pool=pool)

            reply = await self.cluster.over_data_path(member, get)
            self._learn(member, reply.told)
            for i, entry in zip(part, reply.entries, strict=True):
                if isinstance(entry, SharedLocation):
                    value = self._copy_out(member, entry, outs[i] if outs else None)
                    if value is None:
                        stale.append(i)
                        continue
                    self.remember(member, keys[i], entry)
                    results[i] = value
                elif isinstance(entry, Read):
                    self._take(member, i, entry, results)

        parts = [[indices[j] for j in r] for r in runs]
        if len(parts) == 1:  # one connection: no task to spread over
            await run(parts[0])
        else:
            outcomes = await asyncio.gather(*(run(p) for p in parts), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        return stale

    def _take(self, member: Member, i: int, read: Read, results: list[Any]) -> None:
        if read.value is None:
            self.counters["checksum_misses"] += 1
            return
        results[i] = read.value
        self.counters[f"get_bytes_{'local' if member.same_host else 'remote'}"] += read.nbytes
        self.bandwidth.record(read_path(member, read.tier), read.nbytes, read.seconds)

    def _learn(self, member: Member, told: list[tuple[str, SharedLocation]]) -> None:
        """Remember the placements the server told, while there is room: a told place is
        a hint, so it never pushes out a location this client used (and keys already
        remembered keep theirs: a location from our own put or get is at least as new)."""
        if member.pool is None or not told:
            return
        locations = member.locations
        learned = 0
        for key, location in told:
            if len(locations) >= MAX_LOCATIONS:
                break
            if key not in locations:
                locations[key] = location
                learned += 1
        self.counters["placements_learned"] += learned


__all__ = ["GET_BATCH", "Reader", "read_path"]
