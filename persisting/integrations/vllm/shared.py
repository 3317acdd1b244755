"""One KV store per namespace per process, shared by the connector's two sides.

vLLM builds the connector twice: a scheduler side (the manager: lookups, what to store)
and a worker side (the transfers). With one worker they live in the same engine-core
process, and must see the same index (a block the worker just stored is a hit for the next
lookup), so they share one :class:`~persisting.kv.KVStore`, opened on first use and closed
by the last side to let go. Engines in other processes share the namespace's directory,
as the store allows. With ``cluster`` the two sides share one client of the cluster's
namespace instead (:class:`RemoteNamespace`: Pulsing runs once per process).

The counters the connector exports (:class:`Counters`) live beside the store.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persisting.integrations.common.opener import open_engine_store, open_local
from persisting.integrations.common.store import EngineStore
from persisting.integrations.counters import LockedCounters
from persisting.integrations.vllm.settings import ConnectorSettings
from persisting.kv import KVStore


@dataclass
class Counters(LockedCounters):
    """What the connector did in this process (all monotonic)."""

    lookup_hits: int = 0
    lookup_misses: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0
    store_errors: int = 0
    evictions: int = 0
    events_applied: int = 0


@dataclass
class Namespace:
    """A namespace open in this process: its store, counters and unreported evictions."""

    key: tuple[str, str]
    store: KVStore
    counters: Counters
    #: Keys the store evicted that the manager has not told vLLM about yet.
    evicted: deque[str]
    users: int = 0

    @property
    def name(self) -> str:
        return self.store.model


@dataclass
class RemoteNamespace:
    """A namespace of a cluster open in this process: its store (a cluster that does not
    answer is misses until it does) and counters."""

    key: tuple[str, str]
    name: str
    store: EngineStore
    counters: Counters
    users: int = 0


_LOCK = threading.Lock()
_OPEN: dict[tuple[str, str], Namespace | RemoteNamespace] = {}
#: Called with each namespace as it opens (the metrics exporter registers it).
on_open: list[Callable[[Namespace], None]] = []


def acquire(
    settings: ConnectorSettings,
    namespace: str,
    describe: Mapping[str, Any] | None = None,
    *,
    direct_io: bool = False,
) -> Namespace:
    """The open namespace ``namespace`` under ``settings.storage_path`` (opened if need be;
    ``describe``: what it holds, in words, for ``persisting inspect``; ``direct_io``: its
    payloads bypass the page cache, for values vLLM's CPU tier already holds)."""
    if settings.storage_path is None:
        raise ValueError("a namespace of a cluster is not opened here (see PersistingTier)")
    key = (str(Path(settings.storage_path).resolve()), namespace)
    with _LOCK:
        state = _OPEN.get(key)
        assert not isinstance(state, RemoteNamespace)
        if state is None:
            counters = Counters()
            evicted: deque[str] = deque(maxlen=1 << 16)

            def record(victims: list[tuple[str, int]]) -> None:
                counters.add(evictions=len(victims))
                evicted.extend(k for k, _size in victims)

            store = open_local(
                settings,
                namespace,
                memory_bytes=settings.memory_bytes,
                durability=settings.durability,
                on_disk_evict=record,
                result_buffer_bytes=0,
                pinned_memory="off",
                pinned_staging_bytes=0,
                describe=describe,
                direct_io=direct_io,
            )
            state = _OPEN[key] = Namespace(key, store, counters, evicted)
            for hook in on_open:
                hook(state)
        state.users += 1
        return state


def acquire_remote(settings: ConnectorSettings, namespace: str) -> RemoteNamespace:
    """The open namespace ``namespace`` of ``settings.cluster`` (joined if need be; a
    cluster that does not answer is not an error: see
    :class:`~persisting.integrations.common.cluster.Reconnecting`)."""
    if settings.cluster is None:
        raise ValueError("acquire_remote needs settings with cluster")
    key = ("cluster:" + ",".join(settings.cluster.seeds) + "/" + settings.cluster.name, namespace)
    with _LOCK:
        state = _OPEN.get(key)
        assert not isinstance(state, Namespace)
        if state is None:
            store = open_engine_store(settings, namespace)
            state = _OPEN[key] = RemoteNamespace(key, namespace, store, Counters())
        state.users += 1
        return state


def release(state: Namespace | RemoteNamespace) -> None:
    """Let go of ``state``; the last user closes the store (stores finished, metadata
    committed, eviction order saved)."""
    with _LOCK:
        state.users -= 1
        if state.users > 0:
            return
        _OPEN.pop(state.key, None)
    state.store.close()


def open_namespaces() -> list[Namespace]:
    """The local namespaces open in this process."""
    with _LOCK:
        return [ns for ns in _OPEN.values() if isinstance(ns, Namespace)]


def open_counters() -> list[tuple[str, Counters]]:
    """Each namespace open in this process, local or a cluster's, and its counters."""
    with _LOCK:
        return [(ns.name, ns.counters) for ns in _OPEN.values()]


__all__ = [
    "Counters",
    "Namespace",
    "RemoteNamespace",
    "acquire",
    "acquire_remote",
    "on_open",
    "open_counters",
    "open_namespaces",
    "release",
]
