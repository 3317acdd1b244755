"""A KV store's options: which come from the settings, and which do not go together.

What each option means is in :class:`~persisting.kv.store.KVStore`'s docstring; the
settings themselves (with their environment variables and units) in
:class:`persisting.config.KVSettings`.
"""

from __future__ import annotations

from persisting.errors import ConfigError, InvalidKeyError
from persisting.kv.keys import HASH_SCHEMES
from persisting.lance_store import validate_name

#: The options :meth:`KVStore.from_settings` takes from the ``kv`` settings.
SETTINGS_OPTIONS = (
    "memory_bytes",
    "disk_bytes",
    "durability",
    "eviction",
    "admission",
    "max_value_bytes",
    "chunk_size",
    "hash_scheme",
    "key_dtype",
    "result_buffer_bytes",
    "read_threads",
    "pinned_memory",
    "pinned_staging_bytes",
    "write_behind_lag_s",
    "write_behind_bytes",
)


def validate_model(model: object) -> str:
    """``model`` if it can name a namespace (a path-safe name without ``'@'``, which
    separates key parts), else InvalidNameError or InvalidKeyError."""
    name = validate_name(model, "model")
    if "@" in name:
        raise InvalidKeyError(f"model name {name!r} must not contain '@' (it separates key parts)")
    return name


def check_options(
    model: str,
    durability: str,
    memory_bytes: int,
    disk_bytes: int,
    read_threads: int,
    hash_scheme: str,
) -> None:
    """ConfigError (or InvalidKeyError for the model name) for options that do not go
    together, before anything is opened."""
    validate_model(model)
    if durability not in ("sync", "async", "write_back"):
        raise ConfigError(f"durability must be sync, async or write_back, not {durability!r}")
    if memory_bytes < 0 or disk_bytes < 0:
        raise ConfigError("tier capacities must not be negative")
    if read_threads < 1:
        raise ConfigError(f"read_threads must be at least 1, not {read_threads}")
    if durability != "sync" and memory_bytes == 0:
        raise ConfigError(f"durability={durability!r} needs a memory tier (memory_bytes > 0)")
    if hash_scheme not in HASH_SCHEMES:
        raise ConfigError(f"hash_scheme must be one of {HASH_SCHEMES}, not {hash_scheme!r}")


__all__ = ["SETTINGS_OPTIONS", "check_options"]
