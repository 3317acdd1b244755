"""``PersistingConnector``: vLLM's offloading connector, with Persisting as the medium.

Configured entirely in vLLM::

    KVTransferConfig(
        kv_connector="PersistingConnector",
        kv_connector_module_path="persisting.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"storage_path": "/var/lib/persisting", "disk_bytes": "500GiB"},
    )

(or ``"cluster": {"seeds": ["HOST:PORT"], "passphrase_file": PATH}`` in place of
``storage_path``: the same namespace on the members of a ``persisting serve`` cluster).

It is vLLM's ``OffloadingConnector`` (its scheduling of loads and stores, block by block,
asynchronous), with the spec chosen by the engine's platform:

- **a GPU engine** (CUDA or XPU): vLLM's ``TieringOffloadingSpec``, its CPU tier
  (``cpu_bytes`` of page-locked host memory shared by the engine's workers, one row per
  chunk holding every tensor-parallel rank's shard) in front of
  :class:`~persisting.integrations.vllm.tier.PersistingTier`. Every device copy is vLLM's
  own; a chunk Persisting cannot load is a miss vLLM recomputes. Any parallelism vLLM's CPU
  tier takes is taken.
- **vLLM's CPU backend**: :class:`~persisting.integrations.vllm.spec.PersistingOffloadingSpec`,
  which reads blocks straight into the engine's KV cache (one worker per engine; from a
  local root's payload files, or with ``cluster`` from the members of a ``persisting
  serve`` cluster, in one batch per job) and
  reports the blocks whose load failed, which the stock connector cannot (its worker
  asserts every transfer succeeded): by block id for a model with one KV-cache group
  (``get_block_ids_with_load_errors``), by request for a hybrid model
  (``failed_recving``: block ids are not unique across groups, and vLLM then recomputes
  the request from its start). With ``kv_load_failure_policy="recompute"`` vLLM recomputes;
  with its default, ``"fail"``, it fails the request instead. The keys of blocks that
  failed travel back to the scheduler with the worker's metadata, so they are not offered
  again until stored afresh.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput

from persisting.errors import ConfigError
from persisting.integrations.vllm.identity import building_engine
from persisting.integrations.vllm.manager import PersistingManager
from persisting.integrations.vllm.metrics import stop_metrics
from persisting.integrations.vllm.orphan import watch_parent
from persisting.integrations.vllm.settings import connector_settings, tiering_config
from persisting.integrations.vllm.worker import PersistingWorker

log = logging.getLogger(__name__)

SPEC_NAME = "PersistingOffloadingSpec"
SPEC_MODULE = "persisting.integrations.vllm.spec"

#: vLLM's prefix-cache hashes that are seeded at random in each process unless
#: PYTHONHASHSEED is set (vllm/v1/core/kv_cache_utils.py): no block would be found again.
_PER_PROCESS_HASHES = ("xxhash", "xxhash_cbor")


def on_gpu() -> bool:
    """Whether this engine's KV caches are on a device vLLM's CPU tier serves (CUDA-alike
    or XPU: where vLLM's tiered offloading runs its worker)."""
    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())


def _carried(meta: OffloadingWorkerMetadata) -> dict[str, Any]:
    """The fields of vLLM's worker metadata, whichever this vLLM has (0.34 adds
    ``failed_jobs``): what a :class:`PersistingWorkerMetadata` made of it carries."""
    return {name: getattr(meta, name) for name in OffloadingWorkerMetadata.__dataclass_fields__}


@dataclass
class PersistingWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata, plus the keys of blocks that failed to load."""

    failed_keys: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        return PersistingWorkerMetadata(
            **_carried(merged),
            failed_keys=[*self.failed_keys, *getattr(other, "failed_keys", [])],
        )


class PersistingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector over a Persisting storage root."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ConfigError("PersistingConnector needs vLLM's kv_transfer_config")
        extra: dict[str, Any] = transfer.kv_connector_extra_config
        self.tiered = on_gpu()
        if self.tiered:
            transfer.kv_connector_extra_config = extra = tiering_config(extra)
        else:
            if extra.get("spec_name", SPEC_NAME) != SPEC_NAME:
                raise ConfigError(
                    f"PersistingConnector names its own offloading spec; leave out spec_name"
                    f" ({extra['spec_name']!r} given)"
                )
            connector_settings(extra)  # checked before vLLM builds anything
            extra["spec_name"] = SPEC_NAME
            extra["spec_module_path"] = SPEC_MODULE
        algorithm = vllm_config.cache_config.prefix_caching_hash_algo
        if algorithm in _PER_PROCESS_HASHES and os.environ.get("PYTHONHASHSEED") is None:
            raise ConfigError(
                f"PersistingConnector: prefix_caching_hash_algo={algorithm!r} is seeded at"
                " random in every process unless PYTHONHASHSEED is set, so no stored block"
                " would ever be found again: set PYTHONHASHSEED (the same in every engine)"
                " or use sha256"
            )
        if transfer.kv_load_failure_policy != "recompute" and role == KVConnectorRole.SCHEDULER:
            log.warning(
                "PersistingConnector: kv_load_failure_policy=%r fails a request whose block"
                " cannot be loaded (damaged, evicted meanwhile); set it to 'recompute' to"
                " recompute those blocks instead",
                transfer.kv_load_failure_policy,
            )
        self._hybrid = len(kv_cache_config.kv_cache_groups) > 1
        if self._hybrid and not self.tiered and extra.get("sync_load_budget_bytes"):
            raise ConfigError(
                "PersistingConnector: sync_load_budget_bytes does not apply to a model with"
                " several KV-cache groups on vLLM's CPU backend: a block that fails to load"
                " within the step cannot be recomputed there (vLLM takes such failures by"
                " request only, and the request has already run); leave it out"
            )
        watch_parent(stop_metrics)
        with building_engine(vllm_config):
            super().__init__(vllm_config, role, kv_cache_config)

    # -- the worker's side ----------------------------------------------------------------

    def _persisting_worker(self) -> PersistingWorker | None:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if isinstance(worker, PersistingWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._persisting_worker()
        if worker is None or self._hybrid:
            return set()  # several groups: reported by request (get_transfer_results)
        blocks, _jobs = worker.take_load_errors()
        return blocks

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's results, plus the requests of load jobs that failed as a whole (their
        blocks could not be told) and, for a hybrid model, of every load job with a block
        that failed. A load vLLM waits for within the step (0.33, 0.34; no request here)
        is reported by block id instead: see ``get_block_ids_with_load_errors``."""
        worker = self._persisting_worker()
        if worker is None:
            return super().get_transfer_results(finished_req_ids)
        assert self.connector_worker is not None
        requests = dict(self.connector_worker._load_jobs)  # job -> request, before it drains
        results = super().get_transfer_results(finished_req_ids)
        jobs = worker.take_unplaced_jobs()
        if self._hybrid:
            jobs |= worker.take_load_errors()[1]
        failed = {requests.get(job) for job in jobs} - {None}
        if failed:
            results.failed_recving = set(results.failed_recving or ()) | failed
        return results

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        worker = self._persisting_worker()
        failed = worker.take_failed_keys() if worker is not None else []
        if not failed:
            return meta
        base = meta if isinstance(meta, OffloadingWorkerMetadata) else OffloadingWorkerMetadata()
        return PersistingWorkerMetadata(**_carried(base), failed_keys=failed)

    # -- the scheduler's side -------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PersistingWorkerMetadata) and meta.failed_keys:
            manager = self.scheduler.manager
            if isinstance(manager, PersistingManager):
                manager.fail(meta.failed_keys)  # before vLLM retries the request
        super().update_connector_output(connector_output)


__all__ = ["SPEC_MODULE", "SPEC_NAME", "PersistingConnector", "PersistingWorkerMetadata"]
