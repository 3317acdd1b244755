"""``PersistingOffloadingSpec``: Persisting as the medium of vLLM's offloading connector.

vLLM's ``OffloadingConnector`` builds its offloading spec by name (``spec_name``,
``spec_module_path`` in ``kv_connector_extra_config``); :class:`PersistingConnector`
names this one. The spec checks at start what it can serve -- and refuses the rest with
one clear message -- works out the namespace from everything that makes KV incompatible,
and hands vLLM the scheduler-side manager and the worker-side transfers, both over the
namespace's KV store.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

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
from persisting.integrations.vllm.manager import PersistingManager
from persisting.integrations.vllm.metrics import serve_metrics
from persisting.integrations.vllm.namespace import key_dtype, namespace_name
from persisting.integrations.vllm.settings import connector_settings
from persisting.integrations.vllm.shared import acquire
from persisting.integrations.vllm.worker import PersistingWorker

#: What only the connector knows about the engine (vLLM's config beyond the offloading
#: config), handed to the spec it builds: set by PersistingConnector around its
#: construction.
_ENGINE = threading.local()


@contextlib.contextmanager
def engine_facts(**facts: Any) -> Iterator[None]:
    _ENGINE.facts = facts
    try:
        yield
    finally:
        _ENGINE.facts = None


def refuse(what: str) -> ConfigError:
    return ConfigError(f"PersistingConnector: {what}")


def check_supported(config: OffloadingConfig) -> None:
    """Refuse at start what this connector does not serve (one message says what)."""
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
            f"one worker per engine is supported ({given or f'world_size={parallel.world_size}'}"
            " given); run one engine per device and share the storage root between them"
        )
    if len(config.groups) != 1:
        raise refuse(
            f"models with one KV-cache group are supported; this one has {len(config.groups)}"
            " (hybrid attention: sliding window, Mamba): vLLM cannot recompute a failed load"
            " block by block across several groups"
        )
    if config.cache.blocks_per_chunk != 1:
        raise refuse(
            "kv_connector_extra_config 'block_size'/'blocks_per_chunk' must be left out:"
            " Persisting stores one vLLM block per value"
        )
    if config.canonical_layout:
        raise refuse("canonical_layout is not supported; leave it out")


class PersistingOffloadingSpec(OffloadingSpec):
    """The Persisting medium: one KV store namespace per KV layout."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        facts = getattr(_ENGINE, "facts", None)
        if facts is None:
            raise refuse(
                "configure kv_connector='PersistingConnector' with kv_connector_module_path="
                "'persisting.integrations.vllm' (OffloadingConnector alone cannot report a"
                " failed load to vLLM)"
            )
        self.settings = connector_settings(self.extra_config)
        check_supported(config)
        parallel = config.parallel
        layout = {
            "dtype": config.model.dtype,
            "groups": [
                {"id": g.group_id, "tokens": g.tokens_per_block, "layers": list(g.layer_names)}
                for g in config.groups
            ],
            "tokens_per_hash": config.cache.tokens_per_hash,
            "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "parallel": [parallel.rank, parallel.world_size, parallel.tp_size, parallel.pp_size],
            "kv_cache_layout": config.kv_cache_layout,
            "replicated_layout": config.replicated_layout,
            **facts,
        }
        self.namespace = namespace_name(config.model.name, layout, self.settings.namespace)
        self.key_dtype = key_dtype(config.model.dtype)
        self._manager: PersistingManager | None = None
        self._worker: PersistingWorker | None = None

    def _serve_metrics(self, offset: int) -> None:
        """The scheduler side serves on ``metrics_port``, the worker side (often another
        process) on ``metrics_port + 1``; each shows every namespace open in its process."""
        if self.settings.metrics_port is not None:
            serve_metrics(self.settings.metrics_addr, self.settings.metrics_port + offset)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            state = acquire(self.settings, self.namespace)
            self._manager = PersistingManager(
                state, self.key_dtype, self.settings.refresh_interval_s
            )
            self._serve_metrics(0)
            if self.settings.event_topic is not None:
                from persisting.integrations.vllm.events import EventFollower

                follower = EventFollower(
                    state, self.settings.storage_path, self.settings.event_topic,
                    self._manager.forget,
                )  # fmt: skip
                self._manager.on_shutdown.append(follower.stop)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            pages = block_pages(kv_caches)
            state = acquire(self.settings, self.namespace)
            self._worker = PersistingWorker(state, pages, self.settings.io_threads)
            self._serve_metrics(1)
        return self._worker


def block_pages(kv_caches: CanonicalKVCaches) -> BlockPages:
    """Where a block's bytes lie in vLLM's canonical KV caches (one group, host memory)."""
    if len(kv_caches.group_data_refs) != 1:
        raise refuse(f"one KV-cache group is supported, got {len(kv_caches.group_data_refs)}")
    tensors: list[np.ndarray] = []
    pages: list[int] = []
    seen: set[tuple[int, int]] = set()
    for ref in kv_caches.group_data_refs[0]:
        if (ref.tensor_idx, ref.page_size_bytes) in seen:
            continue  # layers sharing one tensor: its bytes are stored once
        seen.add((ref.tensor_idx, ref.page_size_bytes))
        tensor = kv_caches.tensors[ref.tensor_idx].tensor
        if tensor.device.type != "cpu":
            raise refuse(
                f"the KV cache is on {tensor.device}: this version reads blocks into KV caches"
                " in host memory (vLLM's CPU backend) only"
            )
        tensors.append(tensor.numpy())
        pages.append(ref.page_size_bytes)
    return BlockPages(tuple(tensors), tuple(pages))


__all__ = ["PersistingOffloadingSpec", "block_pages", "check_supported", "engine_facts"]
