"""PersistingConnector's CPU worker driven through vLLM's own worker-side classes, without an
engine: the side that runs in an engine environment for ``tests/engines/test_vllm_worker.py``.

    ENGINE_PYTHON tests/engines/vllm_worker_kit.py MODEL_DIR ROOT OUT.json

It builds a real ``VllmConfig`` for the test model (``MODEL_DIR``; no weights are loaded)
with PersistingConnector configured on ``ROOT``, a ``KVCacheConfig`` of one KV-cache group
(two layers, 16 blocks), and ``PersistingConnector`` in the worker role: vLLM's
``OffloadingConnector`` with vLLM's ``OffloadingConnectorWorker``, which builds the
canonical KV caches from real CPU tensors (``register_kv_caches``), submits the jobs of the
``OffloadingConnectorMetadata`` it is bound to -- on vLLM 0.34 as ``DevicePointers`` it
resolves itself -- and collects them (``get_finished``). The scheduler's side is the spec's
own ``PersistingManager`` (it names the blocks to store and load). What each check saw is
written to ``OUT.json``.

vLLM 0.34 on an x86 CPU refuses its CPU platform without triton-cpu (a ``VllmConfig`` cannot
be built on it), so under 0.34 the platform is left unspecified (``VLLM_TARGET_DEVICE``
unset) and the device given as ``cpu``; 0.32 runs on its CPU platform.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

if not metadata.version("vllm").startswith("0.32."):
    os.environ.pop("VLLM_TARGET_DEVICE", None)

import numpy as np

BLOCKS = 16
BLOCK_SIZE = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TIMEOUT_S = 120.0


class Kit:
    def __init__(self, model: str, root: str):
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        from persisting.integrations.vllm.connector import PersistingConnector

        transfer = KVTransferConfig(
            kv_connector="PersistingConnector",
            kv_connector_module_path="persisting.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "storage_path": root,
                "model_version": "worker-kit",
                # vLLM 0.33/0.34's keys: taken (vLLM 0.32 ignores them)
                "sync_load_budget_bytes": 1 << 20,
                "tier_poll_interval_s": 0.01,
            },
        )
        self.config = VllmConfig(
            model_config=ModelConfig(model=model, max_model_len=2048, dtype="bfloat16"),
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=transfer,
        )
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=4, head_size=64, dtype=torch.bfloat16
        )
        page = spec.page_size_bytes
        kv_cache_config = KVCacheConfig(
            num_blocks=BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * BLOCKS, layers=[name], layer_stride=page * BLOCKS, block_stride=page
                )
                for name in LAYERS
            ],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
        )
        # one engine block: [K/V, tokens, heads, head size] of each layer (stride(0) = page)
        self.caches = {
            name: torch.zeros((BLOCKS, 2, BLOCK_SIZE, 4, 64), dtype=torch.bfloat16)
            for name in LAYERS
        }
        self.page = page
        with set_current_vllm_config(self.config):
            self.connector = PersistingConnector(
                self.config, KVConnectorRole.WORKER, kv_cache_config
            )
            self.connector.register_kv_caches(self.caches)
        self.spec = self.connector.connector_worker.spec
        self.manager = self.spec.get_manager()
        self.jobs = 0

    # -- the engine's blocks --------------------------------------------------------------

    def block(self, block_id: int) -> bytes:
        import torch

        return b"".join(
            self.caches[name][block_id].view(-1).view(torch.uint8).numpy().tobytes()
            for name in LAYERS
        )

    def holds(
        self, written: dict[int, bytes], seeds: list[int], block_ids: list[int]
    ) -> list[bool]:
        """Whether each block holds the bytes stored from the block of that seed."""
        return [self.block(b) == written[s] for s, b in zip(seeds, block_ids, strict=True)]

    def fill(self, block_id: int, seed: int) -> None:
        import torch

        for i, name in enumerate(LAYERS):
            data = np.random.default_rng([seed, i]).integers(0, 256, self.page, dtype=np.uint8)
            self.caches[name][block_id].view(-1).view(torch.uint8).copy_(torch.from_numpy(data))

    def zero(self, block_id: int) -> None:
        for name in LAYERS:
            self.caches[name][block_id].zero_()

    # -- jobs, as vLLM's scheduler hands them to the worker -------------------------------

    @staticmethod
    def offload_key(seed: int) -> bytes:
        from vllm.v1.kv_offload.base import make_offload_key

        return make_offload_key(hashlib.sha256(f"kit:{seed}".encode()).digest(), 0)

    @staticmethod
    def device_spec(block_ids: list[int]) -> Any:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        return GPULoadStoreSpec(block_ids, [len(block_ids)], [0])

    def _job(self, req_id: str, src: Any, dst: Any, sync: bool = False) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

        if sync:
            return TransferJob(req_id, src, dst, sync=True)
        return TransferJob(req_id, src, dst)

    @staticmethod
    def _seen() -> dict[str, Any]:
        keys = ("completed", "failed_jobs", "recving", "failed_recving", "error_blocks")
        return {key: [] for key in (*keys, "failed_keys")}

    def _step(self, load_jobs: dict[int, Any], store_jobs: dict[int, Any], seen: Any) -> None:
        """One engine step as vLLM's CPU model runner takes it (``post_forward``): the
        worker submits the step's loads (and the stores the step before deferred), defers
        this step's stores, and reports what finished -- recorded into ``seen``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
        )

        connector = self.connector
        connector.bind_connector_metadata(
            OffloadingConnectorMetadata(load_jobs=load_jobs, store_jobs=store_jobs)
        )
        connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(set())
        seen["recving"] += sorted(results.finished_recving or ())
        seen["failed_recving"] += sorted(getattr(results, "failed_recving", None) or ())
        seen["error_blocks"] += sorted(connector.get_block_ids_with_load_errors())
        meta = connector.build_connector_worker_meta()
        if meta is not None:
            seen["completed"] += sorted(meta.completed_jobs)
            seen["failed_jobs"] += sorted(getattr(meta, "failed_jobs", ()))
            seen["failed_keys"] += list(getattr(meta, "failed_keys", ()))
        connector.clear_connector_metadata()

    def _collect(self, seen: dict[str, Any], until: Any) -> None:
        """Empty steps until ``until(seen)``."""
        deadline = time.monotonic() + TIMEOUT_S
        while not until(seen):
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs not reported: {seen}")
            time.sleep(0.01)
            self._step({}, {}, seen)

    def store(self, seeds: list[int], block_ids: list[int]) -> dict[str, Any]:
        from vllm.v1.kv_offload.base import ReqContext

        context = ReqContext(req_id=f"store-{self.jobs}")
        keys = [self.offload_key(s) for s in seeds]
        for i, key in enumerate(keys):
            context.set_offload_key_position(key, (i + 1) * BLOCK_SIZE)
        prepared = self.manager.prepare_store(keys, context)
        assert prepared is not None
        return self.store_spec(prepared.store_spec, block_ids)

    def store_spec(self, blocks: Any, block_ids: list[int]) -> dict[str, Any]:
        self.jobs += 1
        job = self.jobs
        seen = self._seen()
        store = self._job(f"store-{job}", self.device_spec(block_ids), blocks)
        self._step({}, {job: store}, seen)
        self._collect(seen, lambda s: job in s["completed"])
        return {**seen, "job": job}

    def load(self, seeds: list[int], block_ids: list[int], sync: bool = False) -> dict[str, Any]:
        return self.load_keys(
            [self.manager.key(self.offload_key(s)) for s in seeds], block_ids, sync
        )

    def load_keys(
        self, keys: list[str], block_ids: list[int], sync: bool = False
    ) -> dict[str, Any]:
        from persisting.integrations.vllm.manager import PersistingBlocks

        self.jobs += 1
        job, req = self.jobs, f"load-{self.jobs}"
        for b in block_ids:
            self.zero(b)
        seen = self._seen()
        load = self._job(req, PersistingBlocks(keys), self.device_spec(block_ids), sync)
        self._step({job: load}, {}, seen)
        # what the step's forward pass reads: a sync load is in place by now
        filled = [self.block(b) != bytes(len(self.block(b))) for b in block_ids]
        self._collect(seen, lambda s: job in s["completed"] and (sync or req in s["recving"]))
        return {**seen, "job": job, "req": req, "filled_in_step": filled}


def damage_one(root: Path) -> str:
    """Flip bytes in the middle of the most recent payload file; its name."""
    files = sorted((p for p in root.rglob("*.kv") if p.is_file()), key=lambda p: p.stat().st_mtime)
    path = files[-1]
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))
    return path.name


def main(model: str, root: str, out: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    from persisting.integrations.vllm.connector import PersistingWorkerMetadata
    from persisting.integrations.vllm.identity import engine_namespace
    from persisting.integrations.vllm.manager import PersistingBlocks
    from persisting.integrations.vllm.worker import JOB_FAILURES

    started = time.perf_counter()
    kit = Kit(model, root)
    result: dict[str, Any] = {
        "vllm": metadata.version("vllm"),
        "job_failures": JOB_FAILURES,
        "worker": type(kit.connector.connector_worker.worker).__name__,
        "setup_s": time.perf_counter() - started,
    }
    written: dict[int, bytes] = {}
    for seed, block in zip((1, 2, 3), (1, 2, 3), strict=True):
        kit.fill(block, seed)
        written[seed] = kit.block(block)
    result["store"] = kit.store([1, 2, 3], [1, 2, 3])
    loaded = kit.load([1, 2, 3], [5, 6, 7])
    loaded["identical"] = kit.holds(written, [1, 2, 3], [5, 6, 7])
    result["load"] = loaded

    # A load vLLM waits for within the step (0.33 and 0.34: ``expedited``).
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    if "sync" in TransferJob.__dataclass_fields__:
        sync = kit.load([1, 2, 3], [8, 9, 10], sync=True)
        sync["identical"] = kit.holds(written, [1, 2, 3], [8, 9, 10])
        result["sync_load"] = sync

    # A damaged block: reported by block id, the others loaded.
    result["damaged_file"] = damage_one(Path(root))
    result["damaged"] = kit.load([1, 2, 3], [11, 12, 13])

    # Jobs whose keys are not blocks' keys (an exception in the job, not a ValueError of
    # the pairing): each job finishes and is reported; the worker goes on.
    result["bad_store"] = kit.store_spec(PersistingBlocks(["not-a-key"], [None]), [4])
    result["bad_load"] = kit.load_keys(["garbage"], [14])
    # the two blocks whose files were not damaged (the damaged one is gone from the store)
    whole = [
        s for s, b in ((1, 11), (2, 12), (3, 13)) if b not in result["damaged"]["error_blocks"]
    ]
    after = kit.load(whole[:2], [14, 15])
    after["identical"] = kit.holds(written, whole[:2], [14, 15])
    result["after"] = after

    # vLLM's worker metadata carries failed jobs (0.34): PersistingWorkerMetadata keeps them.
    ours = PersistingWorkerMetadata(failed_keys=["k"])
    ours.mark_completed(7, success=False) if JOB_FAILURES else ours.mark_completed(7)
    theirs = OffloadingWorkerMetadata()
    theirs.mark_completed(8, success=False) if JOB_FAILURES else theirs.mark_completed(8)
    merged = ours.aggregate(theirs)
    result["aggregate"] = {
        "type": type(merged).__name__,
        "completed": sorted(merged.completed_jobs),
        "failed_jobs": sorted(getattr(merged, "failed_jobs", ())),
        "failed_keys": list(getattr(merged, "failed_keys", ())),
    }

    # The lookahead block hashes of vLLM 0.34 (a field of its VllmConfig) name another
    # namespace, and the namespace's description says so.
    if "num_hash_lookahead_tokens" in getattr(type(kit.config), "__dataclass_fields__", {}):
        offloading = kit.spec.config
        plain, _ = engine_namespace(offloading, kit.spec.settings, stored="block-rows",
                                    vllm_config=kit.config)  # fmt: skip
        kit.config.num_hash_lookahead_tokens = 1
        ahead, describe = engine_namespace(offloading, kit.spec.settings, stored="block-rows",
                                           vllm_config=kit.config)  # fmt: skip
        kit.config.num_hash_lookahead_tokens = 0
        result["lookahead"] = {
            "same_namespace_when_off": plain == kit.spec.namespace,
            "other_namespace_when_on": ahead != plain,
            "described": describe.get("hash_lookahead_tokens"),
        }
    result["seconds"] = time.perf_counter() - started
    Path(out).write_text(json.dumps(result, default=str))
    kit.connector.shutdown()
    kit.manager.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
