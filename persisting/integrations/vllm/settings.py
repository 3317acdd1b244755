"""Persisting's settings under vLLM: the connector's ``kv_connector_extra_config``, and the
keys of a ``PersistingTier`` entry in vLLM's ``secondary_tiers``.

The connector's dict carries Persisting's keys and vLLM's own offloading keys side by side:
vLLM's are passed through untouched, ours are the engine adapters' shared keys
(:mod:`persisting.integrations.common.settings`; sizes take units, like every other
Persisting size) and the connector's own, and anything else is refused with the closest
known key, so a typo is an error at start rather than a default silently used. A tier
entry takes the same keys, less those that only mean something to the connector (see
:func:`tier_settings`). Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from persisting.errors import ConfigError
from persisting.integrations.common.settings import EngineSettings, Size, read_settings

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

#: Keys vLLM's SecondaryTierFactory passes to a tier's constructor besides Persisting's own
#: (``locality``: where the tier's storage is, relative to the engine).
VLLM_TIER_KEYS = frozenset({"locality"})


class ConnectorSettings(EngineSettings):
    """What ``kv_connector_extra_config`` says about the Persisting medium: the keys every
    engine adapter shares (:class:`~persisting.integrations.common.settings.EngineSettings`:
    ``storage_path`` or ``cluster``, ``disk_bytes``, ``model_version``, ``namespace``,
    ``io_threads``, ``fsync``, ``eviction``, ``refresh_interval_s``) and the connector's own
    below. With ``storage_path`` blocks live under ``<storage_path>/kv/<namespace>/``; with
    ``cluster`` in the same namespace on the members of a ``persisting serve`` cluster (the
    local-only keys -- ``disk_bytes``, ``fsync``, ``eviction`` -- are then the members')."""

    #: An optional Persisting memory tier in front of the disk (0: none).
    memory_bytes: Size = 0
    #: When a store completes: "sync" (written through), "async" or "write_back" (need a
    #: memory tier).
    durability: Literal["sync", "async", "write_back"] = "sync"
    #: Serve the connector's Prometheus counters on this port (None: not served).
    metrics_port: int | None = Field(default=None, ge=0)
    #: Address the metrics port binds.
    metrics_addr: str = "127.0.0.1"
    #: Apply prewarm/evict events for this namespace from this queue topic of the storage
    #: root (e.g. "kv-events"; None: no events are followed).
    event_topic: str | None = None
    #: On a GPU engine: the size of vLLM's CPU tier in front of Persisting (its
    #: ``cpu_bytes_to_use``), page-locked host memory shared by the engine's workers.
    cpu_bytes: Size = 4 << 30


#: Keys only the connector reads: a tier runs behind vLLM's own CPU tier, in the scheduler.
_CONNECTOR_ONLY = {
    "memory_bytes": "vLLM's CPU tier is the memory in front of this tier",
    "durability": "stores complete when written; vLLM's CPU tier holds the block meanwhile",
    "cpu_bytes": "set vLLM's cpu_bytes_to_use beside secondary_tiers instead",
    "event_topic": "events are followed by PersistingConnector's CPU path only",
}
#: Keys that need a local root (refused beside ``cluster``; key: why).
_LOCAL_ONLY = {
    "memory_bytes": "the memory tier is a local store's; a cluster's members hold their own",
    "durability": "a cluster's members store a value before they answer",
    "event_topic": "the event topic is a queue of a local storage root",
}


def _read(
    options: Mapping[str, Any],
    passed: frozenset[str],
    refused: Mapping[str, str],
    where: str,
    **defaults: Any,
) -> ConnectorSettings:
    """Persisting's keys of ``options`` checked (``passed``: vLLM's keys, skipped)."""
    return read_settings(
        ConnectorSettings,
        options,
        where=where,
        passed=passed,
        refused=refused,
        defaults=defaults,
        missing=f"{where} needs 'storage_path' (the Persisting storage root to keep KV blocks "
        "under) or 'cluster' (the members of a persisting serve cluster)",
    )


def _local_only(settings: ConnectorSettings, options: Mapping[str, Any], where: str) -> None:
    """Refuse, beside ``cluster``, the keys only a local root serves."""
    given = [key for key in _LOCAL_ONLY if key in options] if settings.cluster else []
    if given:
        raise ConfigError(
            f"{where}: {', '.join(given)} do not apply with cluster"
            f" ({'; '.join(_LOCAL_ONLY[k] for k in given)}); leave them out"
        )


def connector_settings(extra_config: Mapping[str, Any] | None) -> ConnectorSettings:
    """Persisting's settings from ``kv_connector_extra_config`` (vLLM's keys ignored)."""
    where = "PersistingConnector's kv_connector_extra_config"
    settings = _read(extra_config or {}, VLLM_KEYS, {}, where)
    _local_only(settings, extra_config or {}, where)
    if settings.durability != "sync" and settings.memory_bytes == 0:
        raise ConfigError(
            f"durability={settings.durability!r} needs a memory tier: set memory_bytes"
        )
    return settings


#: The keys a ``PersistingTier`` entry of ``secondary_tiers`` takes.
TIER_FIELDS = tuple(f for f in ConnectorSettings.model_fields if f not in _CONNECTOR_ONLY)
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
    return _read(options, VLLM_TIER_KEYS, _CONNECTOR_ONLY, "PersistingTier", **TIER_DEFAULTS)


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
