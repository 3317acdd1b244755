"""A namespace in a cluster of ``persisting serve`` members, behind :class:`EngineStore`.

The service's :class:`~persisting.service.SyncKVCacheClient` does the work: keys are placed
by rendezvous hashing, and every batch asks each member holding some of its keys once (a
read is :meth:`~persisting.service.SyncKVCacheClient.batched_get_into`, presence
``batched_contains``, a write ``batched_put``), never once per key. A member that does not
answer costs misses, not an error. A value of parts is read into one buffer and copied
into its parts, and written from one buffer joined from them (the wire carries one value).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from persisting.errors import InvalidValueError
from persisting.integrations.common.store import EngineStore, Read, Write, outcome, scatter

if TYPE_CHECKING:
    from persisting.service import SyncKVCacheClient

log = logging.getLogger(__name__)


class ClusterStore(EngineStore):
    """One namespace of a cluster, through a client that serves it."""

    kind = "cluster"

    def __init__(self, client: SyncKVCacheClient):
        self.kv = client
        self.namespace = client.model

    def _read(self, keys: list[str], views: list[tuple[memoryview, ...]]) -> list[Read]:
        outs = [parts[0] if len(parts) == 1 else bytearray(_size(parts)) for parts in views]
        try:
            layouts = self.kv.batched_get_into(keys, outs)
        except InvalidValueError:  # a stored value of another size: find which, one by one
            return [self._read_one(k, o, p) for k, o, p in zip(keys, outs, views, strict=True)]
        except Exception as exc:
            log.warning("Persisting: reading %d values from the cluster failed: %s", len(keys), exc)
            return ["failed"] * len(keys)
        for out, parts, layout in zip(outs, views, layouts, strict=True):
            if layout is not None and len(parts) > 1:
                scatter(memoryview(out), parts)
        return ["miss" if layout is None else "hit" for layout in layouts]

    def _read_one(self, key: str, out: Any, parts: tuple[memoryview, ...]) -> Read:
        try:
            if self.kv.get_into(key, out) is None:
                return "miss"
        except InvalidValueError as exc:
            log.warning("Persisting: %s is damaged (%s): dropped, the engine recomputes", key, exc)
            self.remove([key])
            return "damaged"
        except Exception as exc:
            log.warning("Persisting: %s not read: %s", key, exc)
            return "failed"
        if len(parts) > 1:
            scatter(memoryview(out), parts)
        return "hit"

    def _write(
        self, keys: list[str], views: list[tuple[memoryview, ...]], parents: list[str | None]
    ) -> list[Write]:
        values = [p[0] if len(p) == 1 else b"".join(p) for p in views]  # sent from memory
        try:
            results = self.kv.batched_put(keys, values, fmt="binary", parents=parents)
        except Exception as exc:  # a failed write is a future miss, never an engine error
            log.warning("Persisting: storing %d values in the cluster failed: %s", len(keys), exc)
            return ["failed"] * len(keys)
        return [outcome(r) for r in results]

    def _exists(self, keys: list[str]) -> list[bool]:
        try:
            return self.kv.batched_contains(keys)
        except Exception as exc:
            log.warning("Persisting: asking the cluster for %d keys failed: %s", len(keys), exc)
            return [False] * len(keys)

    def remove(self, keys: Sequence[Any]) -> int:
        return self.kv.batched_remove(self.check_keys(keys))

    def stats(self) -> dict[str, Any]:
        return self.kv.stats()

    def close(self) -> None:
        self.kv.close()


def _size(parts: tuple[memoryview, ...]) -> int:
    return sum(len(p) for p in parts)


__all__ = ["ClusterStore"]
