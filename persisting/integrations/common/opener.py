"""One opener for every engine adapter: the store its settings name, behind
:class:`~persisting.integrations.common.store.EngineStore`.

``storage_path`` opens the namespace on that local root (:func:`~persisting.kv.open_kv_store`
with the settings' budget, eviction and fsync, and the engine's own store options);
``cluster`` joins the members named by its seeds with the cluster's passphrase and opens
the namespace there (the service's :class:`~persisting.service.SyncKVCacheClient`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from persisting.config import PersistingSettings
from persisting.errors import ConfigError
from persisting.integrations.common.settings import ClusterSettings, EngineSettings
from persisting.integrations.common.store import EngineStore, LocalStore
from persisting.kv import KVStore, open_kv_store


def open_local(
    settings: EngineSettings,
    namespace: str,
    *,
    describe: Mapping[str, Any] | None = None,
    memory_bytes: int = 0,
    durability: str = "sync",
    environment: bool = True,
    directory: str | None = None,
    kv_settings: PersistingSettings | None = None,
    **options: Any,
) -> KVStore:
    """The namespace's :class:`KVStore` on ``settings.storage_path`` (``options``: any other
    store option the engine sets, e.g. ``on_disk_evict``). Options neither ``settings``
    nor ``options`` give come from the ``PERSISTING_*`` environment and TOML, unless
    ``environment`` is False (then the store's own defaults). ``directory``: the namespace's
    directory, where it is not the keys' namespace (LMCache's plugin: keys name the model,
    the directory its weights too); ``kv_settings``: Persisting settings the other options
    come from, in place of the environment's."""
    if settings.storage_path is None:
        raise ValueError("open_local needs settings with storage_path")
    options.setdefault("read_threads", settings.io_threads)
    opener: Any = open_kv_store if environment else KVStore
    if directory is not None:
        options["namespace"] = directory
    if kv_settings is not None:
        options["settings"] = kv_settings
    return opener(
        settings.storage_path,
        namespace,
        memory_bytes=memory_bytes,
        disk_bytes=settings.disk_bytes,
        durability=durability,
        eviction=settings.eviction,
        fsync=settings.fsync,
        describe=describe,
        **options,
    )


def service_client() -> Any:
    """The service's :class:`~persisting.service.SyncKVCacheClient` class (a ConfigError
    when the engine's environment lacks the ``service`` extra)."""
    try:
        from persisting.service import SyncKVCacheClient
    except ImportError as exc:
        raise ConfigError(
            f"the cluster key needs Persisting's service extra in the engine's environment "
            f"(pip install 'persisting[service]'): {exc}"
        ) from exc
    return SyncKVCacheClient


def connect_cluster(cluster: ClusterSettings, namespace: str) -> Any:
    """A :class:`~persisting.service.SyncKVCacheClient` of ``namespace`` in ``cluster``
    (a ConfigError when the engine's environment lacks the ``service`` extra)."""
    return service_client().connect(
        seeds=cluster.seeds, name=cluster.name, model=namespace, passphrase=cluster.passphrase()
    )


def open_engine_store(
    settings: EngineSettings,
    namespace: str,
    *,
    describe: Mapping[str, Any] | None = None,
    memory_bytes: int = 0,
    durability: str = "sync",
    reconnect: bool = True,
    **options: Any,
) -> EngineStore:
    """The store ``settings`` name, for ``namespace`` (the local options are ignored for
    a cluster: its members' settings hold). A cluster that does not answer now is not an
    error but misses, until it answers (an engine starts while its cache is down; see
    :class:`~persisting.integrations.common.cluster.Reconnecting`); ``reconnect=False``
    connects now or raises, for a caller that needs the connected client (``.kv``)."""
    if settings.cluster is not None:
        from persisting.integrations.common.cluster import ClusterStore, Reconnecting

        cluster = settings.cluster
        service_client()  # a missing extra is said at start, whether a member answers or not
        if reconnect:
            return Reconnecting.open(
                namespace, lambda: connect_cluster(cluster, namespace), seeds=cluster.seeds
            )
        return ClusterStore(connect_cluster(cluster, namespace))
    store = open_local(
        settings,
        namespace,
        describe=describe,
        memory_bytes=memory_bytes,
        durability=durability,
        **options,
    )
    return LocalStore(store, settings.io_threads, memory_tier=memory_bytes > 0)


__all__ = ["connect_cluster", "open_engine_store", "open_local"]
