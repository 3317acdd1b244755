"""A client's writes: ``put`` and ``batched_put`` over the members.

On the same host a value is copied into the client's arena and the server stores it from
there, checking it against the checksum the client computed; the arena regions are lent
for the request (:class:`~persisting.service.client.regions.ArenaLoans`), so a cancelled
or timed-out put can never have its bytes overwritten before the server read them. A
client on another host sends values on data connections (:mod:`.bulk`: straight from the
value's memory, hashed as it goes, the checksum after it), or, to a server without a data
port, in messages: inline up to one message part, else uploaded in parts.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from persisting.errors import PersistingError
from persisting.kv import Layout, PutResult, SharedLocation
from persisting.kv.keys import key_string
from persisting.kv.layout import checksum, encode_value
from persisting.kv.tiers import KeyLike
from persisting.service.client.bulk import BulkLink
from persisting.service.client.cluster import Cluster
from persisting.service.client.destination import copy_into
from persisting.service.client.member import Member
from persisting.service.client.regions import ArenaLoans
from persisting.service.same_host import ClientArena, Region

#: Bytes of one batch put over data connections (spread over the member's streams; well
#: inside a session's staging bound on the server).
BULK_BATCH_BYTES = 64 << 20

#: One item of a put: key, layout, payload bytes, parent key.
Item = tuple[str, Layout, memoryview, "str | None"]


class Writer:
    """Writes values for a :class:`~persisting.service.client.KVCacheClient`."""

    def __init__(
        self,
        cluster: Cluster,
        arena: ClientArena | None,
        loans: ArenaLoans | None,
        counters: Counter[str],
        copier: Executor,
        key_of: Callable[[KeyLike], str],
        remember: Callable[[Member, str, SharedLocation], None],
    ):
        self.cluster = cluster
        self.arena = arena
        self.loans = loans
        self.counters = counters
        self._copier = copier
        self._key = key_of
        self._remember = remember

    async def batched_put(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        fmt: str = "KV_2LTD",
        parents: Sequence[KeyLike | None] | None = None,
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

        async def put_share(member: Member, share: list[int]) -> None:
            sizes = [encoded[i][0].nbytes for i in share]
            for part in _batches(share, sizes, self._batch_bytes(member)):
                items = [(texts[i], encoded[i][0], encoded[i][1], parent_texts[i]) for i in part]
                stored = await self._put_items(member, items, fmt)
                for i, result in zip(part, stored, strict=True):
                    results[i] = result

        await self.cluster.on_owners(texts, put_share)
        return [r for r in results if r is not None]

    def _batch_bytes(self, member: Member) -> int:
        """Bytes put in one request (or, on data connections, in one spread over them)."""
        if member.bulk is not None and not member.same_host:
            return BULK_BATCH_BYTES
        arena = self.arena
        return max(self.cluster.message_part_bytes, (arena.size // 4) if arena is not None else 0)

    async def _put_items(self, member: Member, items: list[Item], fmt: str) -> list[PutResult]:
        if member.bulk is not None and not member.same_host:
            return await self._put_bulk(member, items, fmt)
        regions: list[Region] = []
        wire: list[dict[str, Any]] = []
        copy: Future[None] | None = None
        try:
            for key, layout, data, parent in items:
                item: dict[str, Any] = {"key": key, "layout": layout.to_dict(), "parent": parent}
                region = self._region(member, layout.nbytes)
                if region is not None:
                    regions.append(region)
                    copy = self._copy(self.arena.region_view(region), data)  # type: ignore[union-attr]
                    if copy is not None:
                        await asyncio.wrap_future(copy)
                    item["checksum"] = checksum(data)
                    item["source"] = {"arena": region.offset}
                    self.counters["put_bytes_arena"] += layout.nbytes
                else:
                    item["checksum"] = checksum(data)
                    item["source"] = await self._upload(member, data)
                    self.counters["put_bytes_message"] += layout.nbytes
                wire.append(item)
        except BaseException:  # not sent: only our own copy may still write into them
            if copy is not None and not copy.done():
                copy.add_done_callback(lambda _done: self._free(regions))
            else:
                self._free(regions)
            raise
        args: dict[str, Any] = {"items": wire, "fmt": fmt}
        if member.pool is not None:
            args["pool"] = True  # tell us where the values lie: our first gets ask nothing
        if not regions:
            reply = await self.cluster.call(member, "put", **args)
            return self._results(member, items, reply)
        assert self.loans is not None
        try:
            reply = await self.loans.lend(member, regions, "put", **args)
        except PersistingError:
            self._free(regions)  # answered: the server is done with them
            raise
        self._free(regions)
        return self._results(member, items, reply)

    async def _put_bulk(self, member: Member, items: list[Item], fmt: str) -> list[PutResult]:
        """Store ``items`` over data connections, spread over the member's streams by size.
        A put is idempotent (the first writer wins), so one lost connection is tried again
        on a fresh one; a refused credential after a new ``hello``."""
        assert member.bulk is not None
        runs = _batches(
            list(range(len(items))),
            [layout.nbytes for _k, layout, _d, _p in items],
            max(1, -(-sum(layout.nbytes for _k, layout, _d, _p in items) // member.bulk.streams)),
        )
        if len(runs) == 1:  # one connection: no task to spread over
            replies = [await self._put_bulk_run(member, items, fmt)]
        else:
            replies = await asyncio.gather(
                *(self._put_bulk_run(member, [items[i] for i in run], fmt) for run in runs)
            )
        return [PutResult(**entry) for reply in replies for entry in reply]

    async def _put_bulk_run(
        self, member: Member, items: list[Item], fmt: str
    ) -> list[dict[str, Any]]:
        """One put request on one data connection (the failure rules:
        :meth:`Cluster.over_data_path`)."""

        def put(link: BulkLink) -> Awaitable[list[dict[str, Any]]]:
            return link.put(self.cluster.model, fmt, items)

        reply = await self.cluster.over_data_path(member, put)
        self.counters["put_bytes_bulk"] += sum(layout.nbytes for _k, layout, _d, _p in items)
        return reply

    def _results(
        self, member: Member, items: list[Item], reply: list[dict[str, Any]]
    ) -> list[PutResult]:
        """The put's results; pool locations the server told are remembered for gets."""
        results: list[PutResult] = []
        for (key, layout, _data, _parent), entry in zip(items, reply, strict=True):
            where = entry.pop("pool", None)
            if where is not None and member.pool is not None:
                self._remember(member, key, SharedLocation(layout, int(where[0]), int(where[1])))
            results.append(
                PutResult(
                    str(entry["key"]),
                    entry["tier"],
                    bool(entry["durable"]),
                    bool(entry.get("stored", True)),
                    bool(entry.get("conflict", False)),  # absent from older servers
                )
            )
        return results

    def _region(self, member: Member, nbytes: int) -> Region | None:
        if not member.same_host or self.arena is None or self.loans is None:
            return None
        return self.arena.allocate(nbytes)

    def _free(self, regions: list[Region]) -> None:
        for region in regions:
            self.arena.free(region)  # type: ignore[union-attr]

    def _copy(self, dst: memoryview, src: memoryview) -> Future[None] | None:
        """Copy ``src`` into ``dst``: large values on a thread (several copies of a batch
        then run at once), returning its future; small ones here (None)."""
        if len(src) >= (1 << 20):
            return self._copier.submit(copy_into, dst, src)
        copy_into(dst, src)
        return None

    async def _upload(self, member: Member, data: memoryview) -> dict[str, Any]:
        part = self.cluster.message_part_bytes
        if len(data) <= part:
            return {"inline": bytes(data)}
        call = self.cluster.call
        upload = await call(member, "upload_begin", nbytes=len(data))
        await asyncio.gather(
            *(
                call(
                    member,
                    "upload_part",
                    upload=upload,
                    offset=offset,
                    data=bytes(data[offset : offset + part]),
                )
                for offset in range(0, len(data), part)
            )
        )
        return {"upload": upload}


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


__all__ = ["Writer"]
