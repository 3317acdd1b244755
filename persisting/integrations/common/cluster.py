"""A namespace in a cluster of ``persisting serve`` members, behind :class:`EngineStore`.

The service's :class:`~persisting.service.SyncKVCacheClient` does the work: keys are placed
by rendezvous hashing, and every batch asks each member holding some of its keys once (a
read is :meth:`~persisting.service.SyncKVCacheClient.batched_get_into`, presence
``batched_contains``, a write ``batched_put``), never once per key. A member that does not
answer costs misses, not an error. A value of parts is read into one buffer and copied
into its parts, and written from one buffer joined from them (the wire carries one value).

:class:`Reconnecting` is for an engine that must start whether or not the cluster answers
(vLLM's CPU connector): until a client connects, every read is a miss, every write fails
and nothing is present; it tries to connect again in the background every
:data:`RECONNECT_S`. A try starts with a TCP probe of the seeds: where none accepts a
connection (every member down) it stops there, without starting Pulsing in the process.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from persisting.errors import ConfigError, InvalidValueError
from persisting.integrations.common.store import EngineStore, Read, Write, outcome, scatter

if TYPE_CHECKING:
    from persisting.service import SyncKVCacheClient

log = logging.getLogger(__name__)

#: Seconds between two tries to connect to a cluster that did not answer.
RECONNECT_S = 30.0


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


class Reconnecting(EngineStore):
    """A cluster's namespace whose client may not be connected yet: misses, failed writes
    and absences until it is (``connect`` is tried again, on a thread of its own, at most
    every ``retry_s``); then the connected :class:`ClusterStore`'s answers."""

    kind = "cluster"

    def __init__(
        self,
        namespace: str,
        connect: Callable[[], SyncKVCacheClient],
        retry_s: float = RECONNECT_S,
        client: SyncKVCacheClient | None = None,
        seeds: Sequence[str] = (),
    ):
        self.namespace = namespace
        self._connect = connect
        self.seeds = list(seeds)
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._inner: ClusterStore | None = None if client is None else ClusterStore(client)
        self._trying: threading.Thread | None = None
        self._last = time.monotonic() if client is None else 0.0
        self._closed = False

    @classmethod
    def open(
        cls,
        namespace: str,
        connect: Callable[[], SyncKVCacheClient],
        retry_s: float = RECONNECT_S,
        seeds: Sequence[str] = (),
    ) -> Reconnecting:
        """Connect now; a cluster that does not answer is warned about, not raised."""
        try:
            client = _probed(seeds, connect)
        except ConfigError:  # a configuration that can never connect: said at start
            raise
        except Exception as exc:
            log.warning(
                "Persisting: the cluster does not answer (%s): every block is a miss until it"
                " does (tried again every %gs)", exc, retry_s,
            )  # fmt: skip
            return cls(namespace, connect, retry_s, seeds=seeds)
        return cls(namespace, connect, retry_s, client, seeds)

    @property
    def connected(self) -> bool:
        return self._inner is not None

    def _store(self) -> ClusterStore | None:
        with self._lock:
            inner = self._inner
            due = time.monotonic() - self._last >= self.retry_s
            if inner is None and due and self._trying is None and not self._closed:
                self._last = time.monotonic()
                self._trying = threading.Thread(
                    target=self._try, name="persisting-cluster-connect", daemon=True
                )
                self._trying.start()
        return inner

    def _try(self) -> None:
        try:
            client = _probed(self.seeds, self._connect)
        except Exception as exc:
            log.info("Persisting: the cluster still does not answer: %s", exc)
            client = None
        with self._lock:
            self._trying = None
            if client is not None and self._closed:
                close = client
            elif client is not None:
                self._inner, close = ClusterStore(client), None
                log.warning("Persisting: connected to the cluster")
            else:
                close = None
        if close is not None:
            close.close()

    def _read(self, keys: list[str], views: list[tuple[memoryview, ...]]) -> list[Read]:
        inner = self._store()
        return ["miss"] * len(keys) if inner is None else inner._read(keys, views)

    def _write(
        self, keys: list[str], views: list[tuple[memoryview, ...]], parents: list[str | None]
    ) -> list[Write]:
        inner = self._store()
        return ["failed"] * len(keys) if inner is None else inner._write(keys, views, parents)

    def _exists(self, keys: list[str]) -> list[bool]:
        inner = self._store()
        return [False] * len(keys) if inner is None else inner._exists(keys)

    def remove(self, keys: Sequence[Any]) -> int:
        inner = self._store()
        return 0 if inner is None else inner.remove(keys)

    def stats(self) -> dict[str, Any]:
        inner = self._store()
        return {} if inner is None else inner.stats()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()


def _probed(seeds: Sequence[str], connect: Callable[[], SyncKVCacheClient]) -> SyncKVCacheClient:
    """``connect()``, unless no seed accepts a TCP connection (ConnectionError)."""
    if seeds and not any(_accepts(seed) for seed in seeds):
        raise ConnectionError(f"no seed accepts a connection ({', '.join(seeds)})")
    return connect()


def _accepts(seed: str, timeout_s: float = 2.0) -> bool:
    host, _, port = seed.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _size(parts: tuple[memoryview, ...]) -> int:
    return sum(len(p) for p in parts)


__all__ = ["RECONNECT_S", "ClusterStore", "Reconnecting"]
