"""Targets a replay can drive: a local store, or a running server through its client.

A local :class:`~persisting.kv.KVStore` already speaks the
:class:`~persisting.bench.replay.Target` protocol, and so does the service's
:class:`~persisting.service.SyncKVCacheClient`. Each also gets a way to read its
cumulative memory-tier hits, so a replay can split hits by tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persisting.bench.replay import TierHits
from persisting.config import PersistingSettings
from persisting.kv import KVStore, open_kv_store

if TYPE_CHECKING:
    from persisting.service import SyncKVCacheClient


def open_local_target(
    storage_path: str | Path,
    model: str,
    *,
    settings: PersistingSettings | None = None,
    memory_bytes: int | None = None,
    disk_bytes: int | None = None,
    durability: str | None = None,
) -> KVStore:
    """A KV store on ``storage_path`` for ``model``; unset options come from ``settings``."""
    return open_kv_store(
        storage_path,
        model,
        memory_bytes=memory_bytes,
        disk_bytes=disk_bytes,
        durability=durability,  # type: ignore[arg-type]  # the store validates it
        settings=settings,
    )


def store_tier_hits(store: KVStore) -> TierHits:
    """A local store's cumulative memory-tier hits."""
    return lambda: int(store.stats().get("get_hit_memory", 0))


def open_server_target(
    addrs: str | Sequence[str], model: str, settings: PersistingSettings, name: str | None = None
) -> SyncKVCacheClient:
    """A client of the service whose servers are at ``addrs`` (``IP:PORT``; any live member
    of the cluster finds the rest) for ``model``; the actor name and passphrase come from
    ``settings.service``."""
    from persisting.service import SyncKVCacheClient

    return SyncKVCacheClient.connect(
        seeds=[addrs] if isinstance(addrs, str) else list(addrs),
        name=name or settings.service.name,
        model=model,
        passphrase=settings.service.passphrase,
        settings=settings,
    )


def client_tier_hits(client: SyncKVCacheClient) -> TierHits:
    """The servers' cumulative memory-tier hits for the client's model.

    The servers count every memory hit, including a same-host client's reads from a place
    it remembers in a server's shared pool. Disk hits a same-host client reads straight
    from a server's payload files are not all seen by the server, so a replay counts as
    disk every hit that memory did not serve. One stats request per call: a replay reads
    it between requests, outside the timing.
    """

    def read() -> int:
        stats: dict[str, Any] = client.stats()
        return sum(
            int(member.get("stores", {}).get(client.client.model, {}).get("get_hit_memory", 0))
            for member in stats["members"].values()
        )

    return read


__all__ = ["client_tier_hits", "open_local_target", "open_server_target", "store_tier_hits"]
