"""``PersistingConnector``: vLLM's offloading connector, with Persisting as the medium.

Configured entirely in vLLM::

    KVTransferConfig(
        kv_connector="PersistingConnector",
        kv_connector_module_path="persisting.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"storage_path": "/var/lib/persisting", "disk_bytes": "500GiB"},
    )

It is vLLM's ``OffloadingConnector`` (its scheduling of loads and stores, block by block,
asynchronous) with two additions: it names :class:`PersistingOffloadingSpec` as the spec,
and it reports the blocks whose load failed (``get_block_ids_with_load_errors``), which the
stock connector cannot (its worker asserts every transfer succeeded). With
``kv_load_failure_policy="recompute"`` vLLM then recomputes from the first failed block;
with vLLM's default, ``"fail"``, it fails the request instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig

from persisting.errors import ConfigError
from persisting.integrations.vllm.spec import engine_facts
from persisting.integrations.vllm.worker import PersistingWorker

log = logging.getLogger(__name__)

SPEC_NAME = "PersistingOffloadingSpec"
SPEC_MODULE = "persisting.integrations.vllm.spec"

#: vLLM's prefix-cache hashes that are seeded at random in each process unless
#: PYTHONHASHSEED is set (vllm/v1/core/kv_cache_utils.py): no block would be found again.
_PER_PROCESS_HASHES = ("xxhash", "xxhash_cbor")


class PersistingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector over a Persisting storage root."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ConfigError("PersistingConnector needs vLLM's kv_transfer_config")
        extra: dict[str, Any] = transfer.kv_connector_extra_config
        if extra.get("spec_name", SPEC_NAME) != SPEC_NAME:
            raise ConfigError(
                f"PersistingConnector names its own offloading spec; leave out spec_name"
                f" ({extra['spec_name']!r} given)"
            )
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
        with engine_facts(hash_algorithm=algorithm):
            super().__init__(vllm_config, role, kv_cache_config)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        if isinstance(worker, PersistingWorker):
            return worker.take_load_errors()
        return set()


__all__ = ["SPEC_MODULE", "SPEC_NAME", "PersistingConnector"]
