"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

That one dict carries Persisting's keys and vLLM's own offloading keys side by side: vLLM's
are passed through untouched, ours are checked here (sizes take units, like every other
Persisting size), and anything else is refused with the closest known key, so a typo is an
error at start rather than a default silently used. Nothing here imports vLLM.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import ByteSize, TypeAdapter, ValidationError

from persisting.config import DEFAULT_EVICTION, Eviction
from persisting.errors import ConfigError

#: Keys vLLM's OffloadingConnector itself reads from the same dict (vLLM 0.32).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
    }
)

_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` says about the Persisting medium."""

    #: The Persisting storage root; blocks live under ``<storage_path>/kv/<namespace>/``.
    storage_path: Path
    #: Disk budget of the namespace (payload and metadata); beyond it the store evicts.
    disk_bytes: int = 64 << 30
    #: An optional Persisting memory tier in front of the disk (0: none).
    memory_bytes: int = 0
    #: When a store completes: "sync" (written through), "async" or "write_back" (need a
    #: memory tier).
    durability: Literal["sync", "async", "write_back"] = "sync"
    #: Whether sync stores are fsynced (False: whole and renamed into place, not flushed).
    fsync: bool = True
    #: Eviction order: "value" (keeps what will be reused; its counts are shared by the
    #: namespace's engines), "lru", or "prefix" (a prompt's later blocks go before earlier
    #: ones).
    eviction: Eviction = DEFAULT_EVICTION
    #: A readable prefix of the namespace directory (default: the model's last path part);
    #: a digest of the KV layout is always appended.
    namespace: str | None = None
    #: Threads reading blocks of one load (and writing stores) in parallel.
    io_threads: int = 4
    #: Seconds between rescans of the namespace for blocks other engines wrote or removed
    #: (done on a lookup miss, at most this often; 0: on every miss).
    refresh_interval_s: float = 2.0
    #: Serve the connector's Prometheus counters on this port (None: not served).
    metrics_port: int | None = None
    #: Address the metrics port binds.
    metrics_addr: str = "127.0.0.1"
    #: Apply prewarm/evict events for this namespace from this queue topic of the storage
    #: root (e.g. "kv-events"; None: no events are followed).
    event_topic: str | None = None


_FIELDS = tuple(ConnectorSettings.__dataclass_fields__)
_SIZES = {"disk_bytes", "memory_bytes"}
_CHOICES: dict[str, tuple[str, ...]] = {
    "durability": ("sync", "async", "write_back"),
    "eviction": get_args(Eviction),
}


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{name} must be a size in bytes or with a unit, got {value!r}")
    try:
        size = int(_SIZE.validate_python(value))
    except ValidationError:
        raise ConfigError(f"{name} must be a size (4096, 512MB, 64GiB), got {value!r}") from None
    if size < 0:
        raise ConfigError(f"{name} must not be negative, got {value!r}")
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
    if name in _SIZES:
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
    if name == "metrics_port":
        return None if value is None else _number(name, value, int, 0)
    if name == "storage_path":
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(f"storage_path must be a directory path, got {value!r}")
        return Path(value).expanduser()
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def connector_settings(extra_config: Mapping[str, Any] | None) -> ConnectorSettings:
    """Persisting's settings from ``kv_connector_extra_config`` (vLLM's keys ignored)."""
    values: dict[str, Any] = {}
    for key, raw in (extra_config or {}).items():
        if key in VLLM_KEYS:
            continue
        if key not in _FIELDS:
            close = difflib.get_close_matches(str(key), [*_FIELDS, *VLLM_KEYS], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"PersistingConnector: unknown kv_connector_extra_config key {key!r}{hint}; "
                f"Persisting's keys: {', '.join(_FIELDS)}"
            )
        values[key] = _value(key, raw)
    if "storage_path" not in values:
        raise ConfigError(
            "PersistingConnector needs kv_connector_extra_config['storage_path']: the "
            "Persisting storage root to keep KV blocks under"
        )
    settings = ConnectorSettings(**values)
    if settings.durability != "sync" and settings.memory_bytes == 0:
        raise ConfigError(
            f"durability={settings.durability!r} needs a memory tier: set memory_bytes"
        )
    return settings


__all__ = ["VLLM_KEYS", "ConnectorSettings", "connector_settings"]
