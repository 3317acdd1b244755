"""``PersistingHiCacheStorage``: Persisting as SGLang's HiCache L3 storage backend.

SGLang loads it with ``--hicache-storage-backend dynamic`` and an extra config naming this
class (see ``docs/sglang.md``); its factory builds it with ``cls(storage_config, kwargs)``
and then registers the host memory pool, which is when the namespace opens (its name needs
the pool's page shape). With ``"interface_v1": 1`` SGLang calls :meth:`batch_set_v1` and
:meth:`batch_get_v1` with host-pool indices: pages move straight between the pool and the
payload files, or the members of a cluster (:mod:`~persisting.integrations.sglang.
page_store`, on the engine adapters' store: :mod:`persisting.integrations.common`).

The two pairs lay a page's bytes out differently (the v1 pair: the pool's parts end to end;
the generic pair: SGLang's flat data page), so a page set through one pair is never read
through the other: the pair ``interface_v1`` names uses the namespace's plain keys (what
``batch_exists`` answers for), the other pair a key space of its own (``@pair%flat`` or
``@pair%v1`` on each key). A caller mixing the pairs gets misses, never a page of other
bytes.

SGLang runs these methods on its prefetch and backup threads, and an exception (or a
``None``) there stops that thread for the life of the server: every method here answers
``False``, ``0`` or ``None`` on any failure and logs it, and never raises. Only building
the backend raises (an unknown extra-config key, a root it cannot open), which fails the
server's start with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from persisting.integrations.common.opener import open_engine_store
from persisting.integrations.sglang.namespace import PageKeys, PageShape, Shard, namespace_name
from persisting.integrations.sglang.page_store import PageStore
from persisting.integrations.sglang.pages import HostPages, pool_geometry
from persisting.integrations.sglang.settings import StorageSettings, storage_settings
from persisting.kv.namespace.identity import model_identity

log = logging.getLogger(__name__)
T = TypeVar("T")


class PersistingHiCacheStorage(HiCacheStorage):
    """SGLang's L3 tier on a Persisting storage root: bounded, checksummed, shared by
    every rank and server of one configuration, kept across restarts."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        self.storage_config = storage_config
        self.settings: StorageSettings = storage_settings(storage_config.extra_config)
        self.interface_v1 = bool((storage_config.extra_config or {}).get("interface_v1", 0))
        self.shard = _shard(storage_config)
        self.model = storage_config.model_name or "unknown-model"
        self.weights = model_identity(self.model, version=self.settings.model_version)
        self.pages: HostPages | None = None
        self.page_store: PageStore | None = None
        self.keys: PageKeys | None = None
        self.namespace: str | None = None

    # -- registration: the namespace opens once the page shape is known ---------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.page_store is not None:
            return
        pages = HostPages(mem_pool_host)
        shape = PageShape(
            pool=type(mem_pool_host).__name__,
            layout=str(mem_pool_host.layout),
            page_size=pages.page_size,
            dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            part_bytes=pages.part_bytes,
            geometry={**pool_geometry(mem_pool_host), "interface_v1": int(self.interface_v1)},
        )
        s = self.settings
        self.namespace = namespace_name(self.model, self.weights, shape, self.shard, s.namespace)
        store = open_engine_store(
            s,
            self.namespace,
            memory_bytes=0,  # SGLang's host pool is the memory tier
            durability="sync",
            result_buffer_bytes=0,
            pinned_memory="off",
            pinned_staging_bytes=0,
            describe=_describe(self.model, self.weights, shape, self.shard),
        )
        self.pages = pages
        self.keys = PageKeys(self.namespace, shape, self.shard)
        self.page_store = PageStore(store, shape.page_bytes, s.refresh_interval_s)
        log.info(
            "Persisting HiCache storage: namespace %s under %s (%d-byte pages, %s budget)",
            self.namespace,
            s.storage_path or f"the cluster of {s.cluster.seeds if s.cluster else ()}",
            shape.page_bytes,
            s.disk_bytes,
        )

    # -- the zero-copy pair -----------------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Write each page from the host pool; True per page stored (now or before)."""
        if not keys:
            return []
        if not self.shard_writes:
            return [True] * len(keys)  # a replica: the writing rank stores the page
        return self._guard(
            "batch_set_v1",
            [False] * len(keys),
            lambda: self._page_store.write(
                self._keys_of(keys, v1=True),
                self._parts(keys, host_indices),
                self._parent(extra_info),
            ),
        )

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read each page into the host pool; True per page read whole and verified."""
        if not keys:
            return []
        return self._guard(
            "batch_get_v1",
            [False] * len(keys),
            lambda: self._page_store.read(
                self._keys_of(keys, v1=True), self._parts(keys, host_indices)
            ),
        )

    # -- the generic interface (flat page tensors) ----------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Read each page into its flat tensor (``target_locations``); None per miss."""
        targets = list(target_locations or [None] * len(keys))
        ok = self._guard(
            "batch_get",
            [False] * len(keys),
            lambda: self._page_store.read(
                self._keys_of(keys, v1=False), [[_bytes(t)] for t in targets]
            ),
        )
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Write each flat page tensor; True only if every page is stored."""
        if not keys:
            return True
        if not self.shard_writes:
            return True
        flat = [t.contiguous() for t in values or []]
        return all(
            self._guard(
                "batch_set",
                [False] * len(keys),
                lambda: self._page_store.write(
                    self._keys_of(keys, v1=False), [[_bytes(t)] for t in flat], None
                ),
            )
        )

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages from the first are stored (the complete leading run)."""
        if not keys:
            return 0
        return self._guard(
            "batch_exists", 0, lambda: self._page_store.leading_run(self._keys_of(keys))
        )

    # -- the rest ---------------------------------------------------------------------------

    @property
    def shard_writes(self) -> bool:
        """Whether this rank writes: with KV replicated across ranks (MLA) only the
        storage writer does (SGLang's own rule), the others' copies are the same bytes."""
        return bool(getattr(self.storage_config, "is_storage_writer", True))

    def clear(self) -> bool:
        """Remove every page of the namespace (all ranks', all processes')."""
        return self._guard("clear", False, lambda: self._page_store.clear() >= 0)

    def get_stats(self) -> Any:
        """SGLang's storage metrics for the batches since the last call (what its metrics
        collector takes), with Persisting's counters and the store's figures in
        ``.persisting``; None when that fails."""
        return self._guard("get_stats", None, self._stats)

    def close(self) -> None:
        """Finish the batches in flight and close the store (metadata committed)."""
        store, self.page_store = self.page_store, None
        if store is not None:
            self._guard("close", None, store.close)

    # -- helpers ----------------------------------------------------------------------------

    @property
    def _page_store(self) -> PageStore:
        if self.page_store is None:
            raise RuntimeError("no host memory pool registered yet")
        return self.page_store

    def _keys_of(self, keys: list[str], v1: bool | None = None) -> list[str]:
        """The store's keys of SGLang's ``keys`` as moved by the v1 pair (``v1=True``) or
        the generic one (``False``); ``None``: the pair ``interface_v1`` names."""
        if self.keys is None:
            raise RuntimeError("no host memory pool registered yet")
        pair = None
        if v1 is not None and v1 != self.interface_v1:
            pair = "v1" if v1 else "flat"
        return [self.keys.key(k, pair) for k in keys]

    def _parts(self, keys: list[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        if self.pages is None:
            raise RuntimeError("no host memory pool registered yet")
        parts = self.pages.page_parts(host_indices)
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(parts)} pages of host indices")
        return parts

    def _parent(self, extra_info: Any) -> str | None:
        prefix = getattr(extra_info, "prefix_keys", None)
        return self._keys_of([prefix[-1]], v1=True)[0] if prefix else None

    def _stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        page_store = self._page_store
        sets, gets = _drain(page_store.recent_sets), _drain(page_store.recent_gets)
        metrics = StorageMetrics(
            prefetch_pgs=[b.pages for b in gets],
            backup_pgs=[b.pages for b in sets],
            prefetch_bandwidth=[b.gbps for b in gets],
            backup_bandwidth=[b.gbps for b in sets],
        )
        metrics.persisting = {"namespace": self.namespace, **page_store.figures()}
        return metrics

    def _guard(self, what: str, failed: T, call: Callable[[], T]) -> T:
        """Run ``call``; on any exception log it, count it and answer ``failed``."""
        try:
            return call()
        except Exception as exc:
            log.warning("Persisting HiCache storage: %s failed: %r", what, exc)
            if self.page_store is not None:
                self.page_store.counters.add(errors=1)
            return failed


def _shard(config: HiCacheStorageConfig) -> Shard:
    return Shard(
        tp_rank=int(config.tp_rank),
        tp_size=int(config.tp_size),
        pp_rank=int(config.pp_rank),
        pp_size=int(config.pp_size),
        cp_rank=int(getattr(config, "attn_cp_rank", 0) or 0),
        cp_size=int(getattr(config, "attn_cp_size", 1) or 1),
        dcp_rank=int(getattr(config, "dcp_rank", 0) or 0),
        dcp_size=int(getattr(config, "dcp_size", 1) or 1),
        replicated=bool(config.is_mla_model),
        tp_lcm_size=getattr(config, "tp_lcm_size", None),
        split_heads=bool(getattr(config, "should_split_heads", False)),
    )


def _describe(
    model: str, weights: dict[str, str], shape: PageShape, shard: Shard
) -> dict[str, Any]:
    return {
        "engine": "sglang",
        "model": model,
        **weights,
        "dtype": shape.dtype,
        "page_size": shape.page_size,
        "layout": shape.layout,
        "pool": shape.pool,
        "page_bytes": shape.page_bytes,
        **shard.identity(),
    }


def _bytes(tensor: Any) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor (a flat page)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        raise ValueError("a flat page must be a contiguous CPU tensor")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _drain(batches: Any) -> list[Any]:
    out = []
    while batches:
        out.append(batches.popleft())
    return out


__all__ = ["PersistingHiCacheStorage"]
