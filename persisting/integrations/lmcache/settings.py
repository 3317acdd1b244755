"""Settings of the LMCache plugins, read from LMCache's own configuration.

The in-process plugin reads LMCache's ``extra_config`` keys ``persisting.*``
(:func:`settings_from_extra_config`); the L2 adapter of LMCache's multiprocess mode reads
the ``adapter_params`` of its plugin adapter entry (:func:`l2_params`). Sizes are bytes or
a number with a unit (:func:`persisting.config.size_bytes`, the one parser: ``64GiB``,
``512MB``), since LMCache users size in GB. Nothing here imports LMCache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import TypeAdapter, ValidationError

from persisting.config import (
    DEFAULT_EVICTION,
    Eviction,
    GiB,
    KVSettings,
    PersistingSettings,
    closest,
    size_bytes,
)
from persisting.errors import ConfigError

#: extra_config keys start with this prefix.
PREFIX = "persisting."
_KV_FIELDS = frozenset(KVSettings.model_fields)
#: KV settings that are byte sizes (and so accept units).
SIZE_FIELDS = frozenset(name for name in _KV_FIELDS if name.endswith("_bytes"))
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


@dataclass(frozen=True)
class PluginOptions:
    """Settings of the plugin itself (not of the store)."""

    #: Threads writing puts, and threads reading batched gets in parallel.
    io_threads: int = 4
    #: Seconds the pins of an asynchronous lookup are held when its load never comes.
    lookup_pin_ttl_s: float = 60.0
    #: Fault each store's memory tier in at open, in the background (as LMCache's own
    #: LocalCPUBackend allocates its whole buffer up front): ``memory_bytes`` resident per
    #: model from the start, and puts copy into mapped pages instead of faulting each one.
    prefault_memory: bool = True


_OPTION_FIELDS = frozenset(PluginOptions.__dataclass_fields__)


def _plugin_options(raw: dict[str, Any]) -> PluginOptions:
    try:
        threads = int(raw.get("io_threads", PluginOptions.io_threads))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{PREFIX}io_threads must be an int, got {raw['io_threads']!r}") from exc
    if threads < 1:
        raise ConfigError(f"{PREFIX}io_threads must be >= 1, got {threads}")
    try:
        ttl = float(raw.get("lookup_pin_ttl_s", PluginOptions.lookup_pin_ttl_s))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{PREFIX}lookup_pin_ttl_s must be a number, got {raw['lookup_pin_ttl_s']!r}"
        ) from exc
    if not ttl > 0:
        raise ConfigError(f"{PREFIX}lookup_pin_ttl_s must be > 0, got {ttl}")
    prefault = _flag(raw.get("prefault_memory", PluginOptions.prefault_memory), "prefault_memory")
    return PluginOptions(io_threads=threads, lookup_pin_ttl_s=ttl, prefault_memory=prefault)


def _flag(value: Any, name: str) -> bool:
    """A boolean setting: true/false, or the strings YAML and environment variables give
    (pydantic's reading of a bool, as for every other setting)."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError as exc:
        raise ConfigError(f"{PREFIX}{name} must be true or false, got {value!r}") from exc


def settings_from_extra_config(
    extra_config: Mapping[str, Any] | None, chunk_size: int | None = None
) -> tuple[PersistingSettings, PluginOptions]:
    """Persisting settings from LMCache's ``extra_config`` keys ``persisting.*``.

    ``persisting.config`` names a TOML file; ``persisting.storage_path`` and any KV setting
    (``persisting.memory_bytes`` or ``persisting.kv.memory_bytes``...) override it, the
    ``PERSISTING_*`` environment and the defaults. LMCache's ``chunk_size`` is the store's
    chunk size unless ``persisting.chunk_size`` says otherwise. Unknown keys are an error.
    """
    toml_file: str | None = None
    top: dict[str, Any] = {}
    kv: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if chunk_size is not None:
        kv["chunk_size"] = chunk_size
    for raw_key, value in (extra_config or {}).items():
        if not isinstance(raw_key, str) or not raw_key.startswith(PREFIX):
            continue
        name = raw_key[len(PREFIX) :]
        if name.startswith("kv."):
            name = name[3:]
            if name not in _KV_FIELDS:
                raise ConfigError(f"unknown extra_config key {raw_key!r}")
        if name == "config":
            toml_file = str(value)
        elif name == "storage_path":
            top["storage_path"] = value
        elif name in _OPTION_FIELDS:
            options[name] = value
        elif name in SIZE_FIELDS:
            kv[name] = size_bytes(value, raw_key)
        elif name in _KV_FIELDS:
            kv[name] = value
        else:
            known = sorted(["config", "storage_path", *_OPTION_FIELDS, *_KV_FIELDS])
            guess = closest(name, known)
            hint = f"; did you mean {PREFIX + guess!r}?" if guess else ""
            raise ConfigError(
                f"unknown extra_config key {raw_key!r}{hint} (known: {[PREFIX + k for k in known]})"
            )
    plugin_options = _plugin_options(options)
    settings = PersistingSettings.load(toml_file, **top, kv=kv)
    if "durability" not in settings.kv.model_fields_set and settings.kv.memory_bytes > 0:
        # Unless told otherwise, complete puts like LMCache's own backends do: once the chunk
        # is stored and readable (memory tier), with its disk write following behind.
        settings = settings.model_copy(
            update={"kv": settings.kv.model_copy(update={"durability": "async"})}
        )
    return settings, plugin_options


@dataclass(frozen=True)
class L2Params:
    """The L2 adapter's ``adapter_params`` (see ``docs/lmcache.md``)."""

    #: The Persisting storage root; chunks go to ``<storage_path>/kv/<namespace>/``.
    storage_path: Path
    #: Bytes on disk the adapter may use (payload files, counted in 4 KiB blocks).
    capacity: int = 64 * GiB
    #: When a store task completes: ``sync`` (written through), ``async`` (in the memory
    #: tier, written behind) or ``write_back`` (written when evicted from memory).
    durability: Literal["sync", "async", "write_back"] = "sync"
    #: Whether sync stores fsync before they complete (False: page cache, as ``fs`` does).
    fsync: bool = True
    #: A Persisting memory tier in front of the disk (LMCache's L1 is memory already).
    memory_bytes: int = 0
    #: The Persisting model namespace (directory) that holds every key of this adapter.
    namespace: str = "lmcache"
    #: Eviction order when the capacity is reached: ``lru``, ``prefix`` or ``value``.
    eviction: Eviction = DEFAULT_EVICTION
    #: Threads running store and load tasks.
    io_threads: int = 4
    #: Seconds a lookup's lock holds a chunk when LMCache never unlocks it.
    lock_ttl_s: float = 300.0


_L2_FIELDS = {f.name for f in fields(L2Params)}


#: LMCache's own adapters' capacity key (s3, resp, valkey, bigtable, native...): GiB, as a
#: number (``int(gb * 1024**3)`` bytes, as they read it); ``capacity`` takes units instead.
MAX_CAPACITY_GB = "max_capacity_gb"


def l2_params(raw: Mapping[str, Any]) -> L2Params:
    """Validated :class:`L2Params` from ``adapter_params`` (sizes accept units; LMCache's
    ``max_capacity_gb`` is taken as its adapters take it). An unknown key is refused with
    the closest valid one."""
    known = sorted(_L2_FIELDS | {MAX_CAPACITY_GB})
    unknown = sorted(set(raw) - set(known))
    if unknown:
        guess = closest(str(unknown[0]), known)
        hint = f"; did you mean {guess!r}?" if guess else ""
        raise ConfigError(f"unknown adapter_params key {unknown[0]!r}{hint} (known: {known})")
    if not raw.get("storage_path"):
        raise ConfigError("adapter_params.storage_path is required")
    values: dict[str, Any] = {"storage_path": Path(str(raw["storage_path"]))}
    for name in ("capacity", "memory_bytes"):
        if name in raw:
            values[name] = size_bytes(raw[name], f"adapter_params.{name}")
    if MAX_CAPACITY_GB in raw:
        if "capacity" in raw:
            raise ConfigError(
                "adapter_params: give capacity (with a unit) or max_capacity_gb, not both"
            )
        values["capacity"] = _gib(raw[MAX_CAPACITY_GB])
    durability = raw.get("durability", L2Params.durability)
    if durability not in ("sync", "async", "write_back"):
        raise ConfigError(
            f"adapter_params.durability must be sync, async or write_back, not {durability!r}"
        )
    values["durability"] = durability
    if durability != "sync" and values.get("memory_bytes", 0) <= 0:
        raise ConfigError(f"adapter_params.durability={durability!r} needs memory_bytes > 0")
    eviction = raw.get("eviction", L2Params.eviction)
    if eviction not in get_args(Eviction):
        raise ConfigError(f"adapter_params.eviction must be lru, prefix or value, not {eviction!r}")
    values["eviction"] = eviction
    fsync = raw.get("fsync", True)
    if not isinstance(fsync, bool):
        raise ConfigError(f"adapter_params.fsync must be true or false, not {fsync!r}")
    values["fsync"] = fsync
    namespace = raw.get("namespace", L2Params.namespace)
    if not isinstance(namespace, str) or not namespace or "@" in namespace:
        raise ConfigError(f"adapter_params.namespace must be a name without '@', not {namespace!r}")
    values["namespace"] = namespace
    threads = raw.get("io_threads", L2Params.io_threads)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"adapter_params.io_threads must be an int >= 1, not {threads!r}")
    values["io_threads"] = threads
    ttl = raw.get("lock_ttl_s", L2Params.lock_ttl_s)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
        raise ConfigError(f"adapter_params.lock_ttl_s must be a number > 0, not {ttl!r}")
    values["lock_ttl_s"] = float(ttl)
    params = L2Params(**values)
    if params.capacity <= 0:
        raise ConfigError("adapter_params.capacity must be > 0")
    return params


def _gib(value: Any) -> int:
    """``max_capacity_gb`` in bytes, as LMCache's adapters read it (``int(gb * 1024**3)``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(
            f"adapter_params.max_capacity_gb must be a number of GiB > 0 (Persisting "
            f"enforces its capacity; 0 does not turn it off), got {value!r}"
        )
    return int(value * (1 << 30))


__all__ = [
    "MAX_CAPACITY_GB",
    "PREFIX",
    "SIZE_FIELDS",
    "L2Params",
    "PluginOptions",
    "l2_params",
    "settings_from_extra_config",
]
