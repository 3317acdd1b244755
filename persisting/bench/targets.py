"""Targets a replay can drive. A local :class:`~persisting.kv.KVStore` already speaks the
:class:`~persisting.bench.replay.Target` protocol, so opening one is all it takes."""

from __future__ import annotations

from pathlib import Path

from persisting.config import PersistingSettings
from persisting.kv import KVStore, open_kv_store


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


__all__ = ["open_local_target"]
