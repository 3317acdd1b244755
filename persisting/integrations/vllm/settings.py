"""Persisting's settings under vLLM: the connector's ``kv_connector_extra_config``, and the
keys of a ``PersistingTier`` entry in vLLM's ``secondary_tiers``.

The connector's dict carries Persisting's keys and vLLM's own offloading keys side by side:
vLLM's are passed through untouched, ours are checked here (sizes take units, like every
other Persisting size), and anything else is refused with the closest known key, so a typo
is an error at start rather than a default silently used. A tier entry takes the same keys,
less those that only mean something to the connector (see :func:`tier_settings`). Nothing
here imports vLLM.
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

#: Keys vLLM's OffloadingConnector itself reads from the same dict (vLLM 0.32 to 0.34; a
#: key a version does not know is ignored by it).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        # TieringOffloadingSpec's (a GPU engine's connector passes them on to it).
        "eviction_policy",
        "cache_policy_module_path",
        "backpressure",
        "store_threshold",
        "max_tracker_size",
        # vLLM 0.33 and 0.34: loads waited for within the step (the connector's scheduler;
        # bytes, no units), and TieringOffloadingSpec's pause between polls of its tiers.
        "sync_load_budget_bytes",
        "tier_poll_interval_s",
    }
)

_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
#: Keys vLLM's SecondaryTierFactory passes to a tier's constructor besides Persisting's own
#: (``locality``: where the tier's storage is, relative to the engine).
VLLM_TIER_KEYS = frozenset({"locality"})

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
    #: A tier's default is False (:data:`TIER_DEFAULTS`).
    fsync: bool = True
    #: Eviction order: "value" (keeps what will be reused; its counts are shared by the
    #: namespace's engines), "lru", or "prefix" (a prompt's later blocks go before earlier
    #: ones).
    eviction: Eviction = DEFAULT_EVICTION
    #: A readable prefix of the namespace directory (default: the model's last path part);
    #: a digest of the KV layout is always appended.
    namespace: str | None = None
    #: Threads reading blocks of one load (and writing stores) in parallel; a tier's
    #: transfers in flight (its default: :data:`TIER_DEFAULTS`).
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
    #: The weights' version, pinned by the operator: goes into the namespace instead of a
    #: fingerprint of the model's files (None: the files are fingerprinted when found).
    model_version: str | None = None
    #: On a GPU engine: the size of vLLM's CPU tier in front of Persisting (its
    #: ``cpu_bytes_to_use``), page-locked host memory shared by the engine's workers.
    cpu_bytes: int = 4 << 30


_FIELDS = tuple(ConnectorSettings.__dataclass_fields__)
_SIZES = {"disk_bytes", "memory_bytes", "cpu_bytes"}
#: Keys only the connector reads: a tier runs behind vLLM's own CPU tier, in the scheduler.
_CONNECTOR_ONLY = {
    "memory_bytes": "vLLM's CPU tier is the memory in front of this tier",
    "durability": "stores complete when written; vLLM's CPU tier holds the block meanwhile",
    "cpu_bytes": "set vLLM's cpu_bytes_to_use beside secondary_tiers instead",
    "event_topic": "events are followed by PersistingConnector's CPU path only",
}
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
    if name == "model_version" and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"model_version must be a non-empty string, got {value!r}")
    if name == "storage_path":
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(f"storage_path must be a directory path, got {value!r}")
        return Path(value).expanduser()
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def _read(
    options: Mapping[str, Any], fields: tuple[str, ...], passed: frozenset[str], where: str
) -> dict[str, Any]:
    """Persisting's keys of ``options`` checked (``passed``: vLLM's keys, skipped)."""
    values: dict[str, Any] = {}
    for key, raw in options.items():
        if key in passed:
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), [*fields, *passed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            why = f" ({_CONNECTOR_ONLY[key]})" if key in _CONNECTOR_ONLY else ""
            raise ConfigError(
                f"{where}: unknown key {key!r}{hint}{why}; Persisting's keys: {', '.join(fields)}"
            )
        values[key] = _value(key, raw)
    if "storage_path" not in values:
        raise ConfigError(
            f"{where} needs 'storage_path': the Persisting storage root to keep KV blocks under"
        )
    return values


def connector_settings(extra_config: Mapping[str, Any] | None) -> ConnectorSettings:
    """Persisting's settings from ``kv_connector_extra_config`` (vLLM's keys ignored)."""
    where = "PersistingConnector's kv_connector_extra_config"
    settings = ConnectorSettings(**_read(extra_config or {}, _FIELDS, VLLM_KEYS, where))
    if settings.durability != "sync" and settings.memory_bytes == 0:
        raise ConfigError(
            f"durability={settings.durability!r} needs a memory tier: set memory_bytes"
        )
    return settings


#: The keys a ``PersistingTier`` entry of ``secondary_tiers`` takes.
TIER_FIELDS = tuple(f for f in _FIELDS if f not in _CONNECTOR_ONLY)
#: Where a tier's defaults differ from a CPU engine's. It moves whole rows of vLLM's CPU
#: tier with O_DIRECT, which bypasses the kernel's readahead and write-back, so the
#: transfers in flight are all the disk is asked at once, and a disk serves more the more
#: requests it has queued: as many as vLLM's own fs tier keeps (16 a side). And it is a
#: cache behind vLLM's CPU tier: a chunk lost to a machine crash before the disk flushed
#: it is a miss (its header and checksum are checked), so a store does not wait for a
#: flush unless fsync is set.
TIER_DEFAULTS: dict[str, Any] = {"io_threads": 16, "fsync": False}


def tier_settings(options: Mapping[str, Any]) -> ConnectorSettings:
    """Persisting's settings from the keys of a ``PersistingTier`` entry of vLLM's
    ``secondary_tiers`` (what vLLM's factory passes on: the entry less ``type``,
    ``module_path`` and ``backpressure``)."""
    values = _read(options, TIER_FIELDS, VLLM_TIER_KEYS, "PersistingTier")
    return ConnectorSettings(**{**TIER_DEFAULTS, **values})


#: Where the connector puts KV on each kind of engine (see :func:`tiering_config`).
TIER_TYPE = "PersistingTier"
TIER_MODULE = "persisting.integrations.vllm"
TIERING_SPEC = "TieringOffloadingSpec"
#: Marks a config :func:`tiering_config` made (the connector is built once per role, and
#: both roles may share one process and one config).
_CONFIGURED = "persisting_tiering"


def tiering_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` for a GPU engine: vLLM's ``TieringOffloadingSpec`` with
    its CPU tier of ``cpu_bytes`` in front of one ``PersistingTier`` taking the
    connector's Persisting keys (checked first), vLLM's own keys passed on as they are."""
    if extra.get(_CONFIGURED):
        return dict(extra)
    settings = connector_settings(extra)
    refused = [k for k in ("memory_bytes", "durability", "event_topic") if k in extra]
    if refused:
        raise ConfigError(
            f"PersistingConnector on a GPU engine: {', '.join(refused)} do not apply"
            f" ({'; '.join(_CONNECTOR_ONLY[k] for k in refused)}); leave them out"
        )
    given = extra.get("spec_name", TIERING_SPEC)
    if given != TIERING_SPEC:
        raise ConfigError(
            f"PersistingConnector names vLLM's {TIERING_SPEC} on a GPU engine; leave out"
            f" spec_name ({given!r} given)"
        )
    tier = {key: value for key, value in extra.items() if key in TIER_FIELDS}
    out = {key: value for key, value in extra.items() if key in VLLM_KEYS}
    out.update(
        spec_name=TIERING_SPEC,
        cpu_bytes_to_use=settings.cpu_bytes,
        secondary_tiers=[{"type": TIER_TYPE, "module_path": TIER_MODULE, **tier}],
    )
    out[_CONFIGURED] = True
    out.pop("spec_module_path", None)
    return out


__all__ = [
    "TIERING_SPEC",
    "TIER_DEFAULTS",
    "TIER_FIELDS",
    "TIER_MODULE",
    "TIER_TYPE",
    "VLLM_KEYS",
    "VLLM_TIER_KEYS",
    "ConnectorSettings",
    "connector_settings",
    "tier_settings",
]
