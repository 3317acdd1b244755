"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

That one JSON object carries SGLang's own keys (which backend class to load, whether it
speaks the zero-copy interface, prefetch knobs) and Persisting's side by side: SGLang's are
passed through untouched, ours are checked here (sizes take units, like every other
Persisting size), and anything else is refused with the closest known key, so a typo is an
error at start rather than a default silently used. Nothing here imports SGLang.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_args

from pydantic import ByteSize, TypeAdapter, ValidationError

from persisting.config import DEFAULT_EVICTION, Eviction
from persisting.errors import ConfigError

#: Keys SGLang 0.5.23 itself reads from the same object (the dynamic backend's class, the
#: zero-copy switch, and the prefetch knobs HiCache pops before the backend sees them).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)

_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


@dataclass(frozen=True)
class StorageSettings:
    """What the extra config says about the Persisting L3 tier."""

    #: The Persisting storage root; pages live under ``<storage_path>/kv/<namespace>/``.
    storage_path: Path
    #: Disk budget of the namespace (payload and metadata, every process sharing it); beyond
    #: it the store evicts.
    disk_bytes: int = 64 << 30
    #: The weights' version, pinned by the operator: part of the namespace, so KV of other
    #: weights under the same model name is never read. Left out, the model's files are
    #: fingerprinted when SGLang's model path is a local directory or a cached snapshot.
    model_version: str | None = None
    #: A readable prefix of the namespace directory (default: the model's last path part);
    #: a digest of everything that makes KV incompatible is always appended.
    namespace: str | None = None
    #: Threads reading and writing the pages of one batch in parallel.
    io_threads: int = 8
    #: Whether pages are fsynced before a set returns (False: written whole and renamed into
    #: place, so they survive the process, not a power loss; a page lost so is a miss).
    fsync: bool = False
    #: Eviction order: "value" (keeps what will be reused: docs/operating.md#eviction),
    #: "lru", or "prefix" (a prompt's later pages go before earlier ones).
    eviction: Eviction = DEFAULT_EVICTION
    #: Seconds between rescans for pages other processes wrote or removed (done when an
    #: existence check misses, at most this often; 0: on every miss).
    refresh_interval_s: float = 2.0


FIELDS = tuple(f.name for f in fields(StorageSettings))
_CHOICES: dict[str, tuple[str, ...]] = {"eviction": get_args(Eviction)}


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{name} must be a size in bytes or with a unit, got {value!r}")
    try:
        size = int(_SIZE.validate_python(value))
    except ValidationError:
        raise ConfigError(f"{name} must be a size (4096, 512MB, 64GiB), got {value!r}") from None
    if size <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return size


def _number(name: str, value: Any, kind: type[int] | type[float], low: float) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or number < low:
        raise ConfigError(f"{name} must be a number >= {low}, got {value!r}")
    return number


def _value(name: str, value: Any) -> Any:
    if name == "disk_bytes":
        return _size(name, value)
    if name in _CHOICES:
        if value not in _CHOICES[name]:
            raise ConfigError(f"{name} must be one of {', '.join(_CHOICES[name])}, not {value!r}")
        return value
    if name == "fsync":
        try:
            return _BOOL.validate_python(value)
        except ValidationError:
            raise ConfigError(f"fsync must be true or false, got {value!r}") from None
    if name == "io_threads":
        return _number(name, value, int, 1)
    if name == "refresh_interval_s":
        return _number(name, value, float, 0.0)
    if name == "storage_path":
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(f"storage_path must be a directory path, got {value!r}")
        return Path(value).expanduser()
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def storage_settings(extra_config: Mapping[str, Any] | None) -> StorageSettings:
    """Persisting's settings from SGLang's extra config (SGLang's keys ignored)."""
    values: dict[str, Any] = {}
    for key, raw in (extra_config or {}).items():
        if key in SGLANG_KEYS:
            continue
        if key not in FIELDS:
            close = difflib.get_close_matches(str(key), [*FIELDS, *SGLANG_KEYS], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"PersistingHiCacheStorage: unknown extra-config key {key!r}{hint}; "
                f"Persisting's keys: {', '.join(FIELDS)}"
            )
        values[key] = _value(key, raw)
    if "storage_path" not in values:
        raise ConfigError(
            "PersistingHiCacheStorage needs storage_path in --hicache-storage-backend-"
            "extra-config: the Persisting storage root to keep KV pages under"
        )
    return StorageSettings(**values)


__all__ = ["FIELDS", "SGLANG_KEYS", "StorageSettings", "storage_settings"]
