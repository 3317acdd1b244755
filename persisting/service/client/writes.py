"""A client's writes: ``put`` and ``batched_put`` over the members.

A value is written one way: over the member's data connections (:mod:`.link`; TCP to
another host, the Unix socket on the member's host), sent straight from the value's memory
and hashed as it goes, its checksum after it; a batch is spread over the connections by
size. On the member's host the reply says where each stored value lies in the shared pool,
so the writer's first get of it asks nothing.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from persisting.errors import PersistingError
from persisting.kv import Layout, PutResult, SharedLocation
from persisting.kv.keys import key_string
from persisting.kv.layout import encode_value
from persisting.kv.paths.tiers import KeyLike
from persisting.service.client.cluster import Cluster
from persisting.service.client.link import DataLink, PutItem
from persisting.service.client.member import Member

#: Bytes of one batch put on a member's connections (spread over them; well inside a
#: session's bound on bytes in flight on the server).
BATCH_BYTES = 64 << 20


class Writer:
    """Writes values for a :class:`~persisting.service.client.KVCacheClient`."""

    def __init__(
        self,
        cluster: Cluster,
        counters: Counter[str],
        key_of: Callable[[KeyLike], str],
        remember: Callable[[Member, str, SharedLocation], None],
    ):
        self.cluster = cluster
        self.counters = counters
        self._key = key_of
        self._remember = remember

    async def batched_put(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        fmt: str = "KV_2LTD",
        parents: Sequence[KeyLike | None] | None = None,
        check_shape: bool = True,
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
        # validated before any network
        encoded = [encode_value(v, fmt, check_shape=check_shape) for v in values]
        results: list[PutResult | None] = [None] * len(texts)

        async def put_share(member: Member, share: list[int]) -> None:
            sizes = [encoded[i][0].nbytes for i in share]
            for part in _batches(share, sizes, BATCH_BYTES):
                items = [(texts[i], encoded[i][0], encoded[i][1], parent_texts[i]) for i in part]
                done = await self._put(member, items, fmt, check_shape)
                for i, result in zip(part, done, strict=True):
                    results[i] = result

        await self.cluster.on_owners(texts, put_share)
        return [r for r in results if r is not None]

    async def put_on(self, member: Member, items: list[PutItem]) -> list[PutResult]:
        """Store ``items`` on ``member`` itself (a copy a member sends another, in the
        layout it was stored with, unchecked: it was checked when first stored), in batches
        of at most :data:`BATCH_BYTES`."""
        sizes = [layout.nbytes for _k, layout, _d, _p in items]
        results: list[PutResult] = []
        for part in _batches(list(range(len(items))), sizes, BATCH_BYTES):
            chosen = [items[i] for i in part]
            results.extend(await self._put(member, chosen, "binary", check_shape=False))
        return results

    async def _put(
        self, member: Member, items: list[PutItem], fmt: str, check_shape: bool = True
    ) -> list[PutResult]:
        """Store ``items`` on ``member``, spread over its connections by size. A put is
        idempotent (the first writer wins), so a lost connection is tried again on a fresh
        one (:meth:`Cluster.over_data_path`)."""
        streams = member.link.streams if member.link is not None else 1
        sizes = [layout.nbytes for _k, layout, _d, _p in items]
        runs = _batches(list(range(len(items))), sizes, max(1, -(-sum(sizes) // streams)))
        pool = member.pool is not None

        async def run(part: list[int]) -> list[PutResult]:
            chosen = [items[i] for i in part]

            def put(link: DataLink) -> Awaitable[list[dict[str, Any]]]:
                return link.put(self.cluster.model, fmt, chosen, pool=pool, checked=check_shape)

            reply = await self.cluster.over_data_path(member, put)
            self.counters["put_bytes"] += sum(layout.nbytes for _k, layout, _d, _p in chosen)
            return self._results(member, chosen, reply)

        if len(runs) == 1:  # one connection: no task to spread over
            return await run(runs[0])
        done = await asyncio.gather(*(run(part) for part in runs))
        return [result for results in done for result in results]

    def _results(
        self, member: Member, items: list[PutItem], reply: list[dict[str, Any]]
    ) -> list[PutResult]:
        """The put's results; pool locations the server told are remembered for gets."""
        results: list[PutResult] = []
        for (key, layout, _data, _parent), entry in zip(items, reply, strict=True):
            where = entry.get("pool")
            if where is not None and member.pool is not None:
                self._remember(member, key, _place(layout, where))
            results.append(
                PutResult(
                    str(entry["key"]),
                    entry["tier"],
                    bool(entry["durable"]),
                    bool(entry.get("stored", True)),
                    bool(entry.get("conflict", False)),
                )
            )
        return results


def _place(layout: Layout, where: Any) -> SharedLocation:
    return SharedLocation(layout, int(where[0]), int(where[1]))


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


__all__ = ["BATCH_BYTES", "Writer"]
