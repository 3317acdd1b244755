"""What every operator action on a storage root shares: opening it, and what a dataset is."""

from __future__ import annotations

from pathlib import Path

from persisting.errors import ConfigError, PersistingError
from persisting.lance_store import StorageRoot

KV_METADATA = "meta.lance"
#: Errors a damaged or concurrently changed dataset may raise from Lance or the filesystem.
_DATASET_ERRORS = (PersistingError, OSError, ValueError, RuntimeError)


def open_root(path: str | Path) -> StorageRoot:
    """The storage root at ``path``; a path that does not exist (or is a file) is a
    ConfigError."""
    store = StorageRoot(path)
    if store.root.exists() and not store.root.is_dir():
        raise ConfigError(f"{store.root} is a file, not a storage root")
    if not store.root.is_dir():
        raise ConfigError(
            f"no storage root at {store.root} (check --storage-path or PERSISTING_STORAGE_PATH)"
        )
    return store


__all__ = ["KV_METADATA", "open_root"]
