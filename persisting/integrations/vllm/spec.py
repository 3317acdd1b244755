"""``PersistingOffloadingSpec``: Persisting as the medium of vLLM's offloading connector on
CPU engines.

vLLM's ``OffloadingConnector`` builds its offloading spec by name (``spec_name``,
``spec_module_path`` in ``kv_connector_extra_config``); :class:`PersistingConnector`
names this one on vLLM's CPU backend (on a GPU it names vLLM's ``TieringOffloadingSpec``
with :class:`~persisting.integrations.vllm.tier.PersistingTier` behind vLLM's CPU tier).
The spec checks at start what it can serve -- and refuses the rest with one clear message
-- works out the namespace from everything that makes KV incompatible, and hands vLLM the
scheduler-side manager and the worker-side transfers, both over the namespace's KV store:
under ``storage_path``, or with ``cluster`` the namespace of the same name on the members of
a ``persisting serve`` cluster.
"""

from __future__ import annotations

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from persisting.errors import ConfigError
from persisting.integrations.vllm.blocks import BlockPages
from persisting.integrations.vllm.identity import current_engine, engine_namespace
from persisting.integrations.vllm.manager import PersistingManager
from persisting.integrations.vllm.metrics import serve_metrics
from persisting.integrations.vllm.namespace import key_dtype
from persisting.integrations.vllm.settings import connector_settings
from persisting.integrations.vllm.shared import (
    Namespace,
    RemoteNamespace,
    acquire,
    acquire_remote,
)
from persisting.integrations.vllm.worker import DeviceRows, PersistingWorker


def refuse(what: str) -> ConfigError:
    return ConfigError(f"PersistingConnector: {what}")


def check_supported(config: OffloadingConfig) -> None:
    """Refuse at start what this path does not serve (one message says what)."""
    parallel = config.parallel
    sizes = {
        "tensor_parallel_size": parallel.tp_size,
        "pipeline_parallel_size": parallel.pp_size,
        "prefill_context_parallel_size": parallel.pcp_size,
        "decode_context_parallel_size": parallel.dcp_size,
    }
    if parallel.world_size != 1 or any(v != 1 for v in sizes.values()):
        given = ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1)
        raise refuse(
            f"one worker per engine is supported on vLLM's CPU backend"
            f" ({given or f'world_size={parallel.world_size}'} given); run one engine per"
            " socket and share the storage root between them (GPU engines take any"
            " parallelism vLLM's CPU tier takes)"
        )
    if config.cache.blocks_per_chunk != 1:
        raise refuse(
            "kv_connector_extra_config 'block_size'/'blocks_per_chunk' must be left out on"
            " vLLM's CPU backend: Persisting stores one vLLM block per value there"
        )
    if config.canonical_layout:
        raise refuse("canonical_layout is not supported on vLLM's CPU backend; leave it out")


class PersistingOffloadingSpec(OffloadingSpec):
    """The Persisting medium: one KV store namespace per KV layout."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        vllm_config = current_engine()
        if vllm_config is None:
            raise refuse(
                "configure kv_connector='PersistingConnector' with kv_connector_module_path="
                "'persisting.integrations.vllm' (OffloadingConnector alone cannot report a"
                " failed load to vLLM)"
            )
        self.settings = connector_settings(self.extra_config)
        check_supported(config)
        self.namespace, self.describe = engine_namespace(
            config, self.settings, stored="block-rows", vllm_config=vllm_config
        )
        self.key_dtype = key_dtype(config.model.dtype)
        self.spans = {
            g.group_id: g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups
        }
        self.group_ids = [g.group_id for g in config.groups]
        self._manager: PersistingManager | None = None
        self._worker: PersistingWorker | None = None

    def _serve_metrics(self, offset: int) -> None:
        """The scheduler side serves on ``metrics_port``, the worker side (often another
        process) on ``metrics_port + 1``; each shows every namespace open in its process."""
        if self.settings.metrics_port is not None:
            serve_metrics(self.settings.metrics_addr, self.settings.metrics_port + offset)

    def _acquire(self) -> Namespace | RemoteNamespace:
        """The namespace this process shares between the two sides: on the local root, or
        (``cluster``) the same name on the cluster's members."""
        if self.settings.cluster is not None:
            return acquire_remote(self.settings, self.namespace)
        return acquire(self.settings, self.namespace, self.describe)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._serve_metrics(0)
            state = self._acquire()
            self._manager = PersistingManager(
                state, self.key_dtype, self.settings.refresh_interval_s, self.spans
            )
            if self.settings.event_topic is not None:
                from persisting.integrations.vllm.events import EventFollower

                assert isinstance(state, Namespace)  # no event_topic with cluster
                assert self.settings.storage_path is not None
                follower = EventFollower(
                    state, self.settings.storage_path, self.settings.event_topic,
                    self._manager.forget,
                )  # fmt: skip
                self._manager.on_shutdown.append(follower.stop)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            pages = block_pages(kv_caches, self.group_ids)
            self._serve_metrics(1)
            state = self._acquire()
            rows = DeviceRows(kv_caches, self.group_ids)
            self._worker = PersistingWorker(state, pages, self.settings.io_threads, rows)
        return self._worker


def block_pages(kv_caches: CanonicalKVCaches, group_ids: list[int]) -> dict[int, BlockPages]:
    """Where a block's bytes lie in vLLM's canonical KV caches (host memory), for each
    offloaded KV-cache group (``group_ids``: vLLM's order of ``group_data_refs``)."""
    if len(kv_caches.group_data_refs) != len(group_ids):
        raise refuse(
            f"{len(kv_caches.group_data_refs)} KV-cache groups in the caches for"
            f" {len(group_ids)} offloaded"
        )
    out: dict[int, BlockPages] = {}
    for group, refs in zip(group_ids, kv_caches.group_data_refs, strict=True):
        tensors: list[np.ndarray] = []
        pages: list[int] = []
        seen: set[tuple[int, int]] = set()
        for ref in refs:
            if (ref.tensor_idx, ref.page_size_bytes) in seen:
                continue  # layers sharing one tensor: its bytes are stored once
            seen.add((ref.tensor_idx, ref.page_size_bytes))
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            if tensor.device.type != "cpu":
                raise refuse(
                    f"the KV cache is on {tensor.device} but this is the CPU path (vLLM's"
                    " platform said CPU); report this configuration"
                )
            tensors.append(tensor.numpy())
            pages.append(ref.page_size_bytes)
        out[group] = BlockPages(tuple(tensors), tuple(pages))
    return out


__all__ = ["PersistingOffloadingSpec", "block_pages", "check_supported"]
