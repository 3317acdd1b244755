"""Settings of the LMCache plugins, read from LMCache's own configuration.

The in-process plugin reads LMCache's ``extra_config`` keys ``persisting.*``
(:func:`settings_from_extra_config`); the L2 adapter of LMCache's multiprocess mode reads
the ``adapter_params`` of its plugin adapter entry (:func:`l2_params`). Sizes are bytes or
a number with a unit (:func:`persisting.config.size_bytes`, the one parser: ``64GiB``,
``512MB``), since LMCache users size in GB. Nothing here imports LMCache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from persisting.config import KVSettings, PersistingSettings, closest, size_bytes
from persisting.errors import ConfigError
from persisting.integrations.common.settings import (
    ClusterSettings,
    EngineSettings,
    Size,
    read_settings,
)

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
    #: The members of a ``persisting serve`` cluster holding the chunks, in place of a
    #: local ``storage_path``.
    cluster: ClusterSettings | None = None


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
    cluster = _cluster(raw["cluster"]) if raw.get("cluster") is not None else None
    return PluginOptions(
        io_threads=threads, lookup_pin_ttl_s=ttl, prefault_memory=prefault, cluster=cluster
    )


def _cluster(value: Any) -> ClusterSettings:
    """``persisting.cluster``: a mapping, or its JSON text (as an environment variable
    gives it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{PREFIX}cluster must be a mapping or its JSON: {exc}") from None
    try:
        return ClusterSettings.model_validate(value)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        at = f".{where}" if where else ""
        raise ConfigError(f"{PREFIX}cluster{at}: {error['msg']}") from None


def engine_settings(settings: PersistingSettings, options: PluginOptions) -> EngineSettings:
    """The shared engine settings of the plugin (where its stores are, their budget,
    eviction, fsync and threads), from its Persisting settings and options."""
    kv = settings.kv
    return EngineSettings(
        storage_path=None if options.cluster is not None else settings.storage_path,
        cluster=options.cluster,
        disk_bytes=kv.disk_bytes,
        model_version=kv.model_version,
        io_threads=options.io_threads,
        eviction=kv.eviction,
    )


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
            if (extra_config or {}).get(PREFIX + "cluster") is not None:
                raise ConfigError(f"give {PREFIX}storage_path or {PREFIX}cluster, not both")
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


class L2Params(EngineSettings):
    """The L2 adapter's ``adapter_params`` (see ``docs/lmcache.md``): the shared engine keys
    (``storage_path`` or ``cluster``, ``eviction``, ``fsync``, ``io_threads``; its
    ``capacity`` is the shared ``disk_bytes``) and the adapter's own."""

    #: The Persisting namespace that holds every key of this adapter (used as it is).
    namespace: str = "lmcache"
    #: When a store task completes: ``sync`` (written through), ``async`` (in the memory
    #: tier, written behind) or ``write_back`` (written when evicted from memory).
    durability: Literal["sync", "async", "write_back"] = "sync"
    #: A Persisting memory tier in front of the disk (LMCache's L1 is memory already).
    memory_bytes: Size = 0
    #: Seconds a lookup's lock holds a chunk when LMCache never unlocks it.
    lock_ttl_s: float = Field(default=300.0, gt=0)

    @property
    def capacity(self) -> int:
        """Bytes on disk the adapter may use (payload files, counted in 4 KiB blocks)."""
        return self.disk_bytes

    @field_validator("namespace")
    @classmethod
    def _plain(cls, value: str) -> str:
        if "@" in value:
            raise ValueError(f"must be a name without '@', not {value!r}")
        return value

    @model_validator(mode="after")
    def _fits(self) -> L2Params:
        if self.disk_bytes <= 0:
            raise ValueError("capacity must be > 0")
        if self.durability != "sync" and self.memory_bytes <= 0 and self.cluster is None:
            raise ValueError(f"durability={self.durability!r} needs memory_bytes > 0")
        return self


#: LMCache's own adapters' capacity key (s3, resp, valkey, bigtable, native...): GiB, as a
#: number (``int(gb * 1024**3)`` bytes, as they read it); ``capacity`` takes units instead.
MAX_CAPACITY_GB = "max_capacity_gb"
#: Shared engine keys that mean nothing to the L2 adapter.
_L2_REFUSED = {
    "disk_bytes": "the L2 adapter's is capacity",
    "model_version": "the adapter stores every model's chunks in its one namespace",
    "refresh_interval_s": "one adapter serves its namespace",
}


def l2_params(raw: Mapping[str, Any]) -> L2Params:
    """Validated :class:`L2Params` from ``adapter_params`` (sizes accept units; LMCache's
    ``max_capacity_gb`` is taken as its adapters take it). An unknown key is refused with
    the closest valid one."""
    options = dict(raw)
    defaults: dict[str, Any] = {}
    if "capacity" in options:
        defaults["disk_bytes"] = options.pop("capacity")
    if MAX_CAPACITY_GB in options:
        if "disk_bytes" in defaults:
            raise ConfigError(
                "adapter_params: give capacity (with a unit) or max_capacity_gb, not both"
            )
        defaults["disk_bytes"] = _gib(options.pop(MAX_CAPACITY_GB))
    try:
        return read_settings(
            L2Params,
            options,
            where="adapter_params",
            passed=("capacity", MAX_CAPACITY_GB),
            refused=_L2_REFUSED,
            defaults=defaults,
            noun="adapter_params key",
            missing="adapter_params.storage_path (the Persisting storage root) or "
            "adapter_params.cluster (the members of a persisting serve cluster) is required",
        )
    except ConfigError as exc:  # the shared key's name is LMCache's capacity here
        raise ConfigError(
            str(exc).replace("adapter_params: disk_bytes", "adapter_params: capacity")
        ) from None


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
    "engine_settings",
    "l2_params",
    "settings_from_extra_config",
]
