"""Where the L2 adapter keeps its chunks: its configuration object, its namespace's claim
and its store, on a local root or in a cluster of ``persisting serve`` members.

A local root's namespace is claimed by one adapter (or server) at a time and records its
status for ``persisting stats``; a cluster's members own theirs (each client opens the
namespace there), so nothing is claimed. Either way the adapter gets an
:class:`~persisting.integrations.common.store.EngineStore` from the shared opener, whose
``kv`` (a :class:`~persisting.kv.KVStore` or the cluster's client) takes the typed calls
that keep each chunk's layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from persisting.config import size_text
from persisting.integrations.common.opener import open_engine_store, open_local
from persisting.integrations.common.store import EngineStore, LocalStore
from persisting.integrations.lmcache.settings import L2Params, l2_params
from persisting.kv.namespace.owners import OwnerClaim, claim_model


class NoClaim:
    """The claim of a namespace in a cluster: its members hold it; nothing to record."""

    def update(self, **_fields: Any) -> None:
        return None

    def release(self) -> None:
        return None


def claim_adapter(params: L2Params) -> OwnerClaim | NoClaim:
    """Claim the adapter's namespace (NamespaceOwnedError naming the holder if a live
    adapter or server serves it), recording the settings ``persisting stats`` reports."""
    if params.storage_path is None:
        return NoClaim()
    what = (
        f"LMCache L2 adapter, namespace {params.namespace!r}, capacity {size_text(params.capacity)}"
    )
    details = {
        "capacity": params.capacity,
        "memory_bytes": params.memory_bytes,
        "durability": params.durability,
        "fsync": params.fsync,
        "eviction": params.eviction,
        "namespace": params.namespace,
    }
    return claim_model(
        params.storage_path, params.namespace, role="l2-adapter", what=what, details=details
    )


def open_adapter_store(
    params: L2Params, on_disk_evict: Callable[[list[tuple[str, int]]], None]
) -> EngineStore:
    """The adapter's store: its namespace in the cluster, or on its local root."""
    if params.cluster is not None:
        return open_engine_store(params, params.namespace, reconnect=False)  # needs .kv
    store = open_local(
        params,
        params.namespace,
        memory_bytes=params.memory_bytes,
        durability=params.durability,
        environment=False,  # adapter_params alone configure the adapter
        describe=None,
        result_buffer_bytes=0,
        # Each chunk is read whole on the io thread that loads it (the task's chunks are
        # spread over io_threads already), its checksum made as it lands; parts on the
        # store's own reader threads would add a hand-off per chunk and a second pass over
        # it for the checksum.
        read_threads=1,
        on_disk_evict=on_disk_evict,
    )
    return LocalStore(store, 1, memory_tier=params.memory_bytes > 0)


class PersistingL2AdapterConfig(L2AdapterConfigBase):
    """LMCache's config object for the adapter; found by LMCache's plugin factory by name
    (``<class_name>Config``) and built from ``adapter_params``."""

    def __init__(self, params: L2Params) -> None:
        self.params = params

    @classmethod
    def from_dict(cls, d: dict) -> PersistingL2AdapterConfig:
        return cls(l2_params(d))

    @classmethod
    def help(cls) -> str:
        return (
            "Persisting L2 adapter adapter_params:\n"
            "- storage_path (str): the Persisting storage root, or\n"
            '- cluster ({"seeds": ["HOST:PORT"], "name": "kvstore", "passphrase_file": PATH}):\n'
            "  the members of a persisting serve cluster (one of the two is required)\n"
            "- capacity (bytes or '500GiB', default 64GiB): bytes on disk\n"
            "  (or max_capacity_gb, a number of GiB, as LMCache's own adapters take it)\n"
            "- durability ('sync' | 'async' | 'write_back', default 'sync')\n"
            "- fsync (bool, default true): sync stores fsync before completing\n"
            "- memory_bytes (default 0), namespace (default 'lmcache'),\n"
            "  eviction ('lru' | 'prefix' | 'value'), io_threads (4), lock_ttl_s (300)"
        )


__all__ = ["NoClaim", "PersistingL2AdapterConfig", "claim_adapter", "open_adapter_store"]
