"""The baseline of ``benchmarks/vllm_ttft.py``: vLLM's OffloadingConnector over one file
per block, as simple as a file tier gets.

A block's rows of every KV tensor are written end to end into ``<dir>/<key hex>`` (through
a temporary name, then renamed); a load opens the file and reads it with one ``preadv``
straight into the block's rows. No index (a lookup is an ``exists``), no checksum, no
budget, no eviction, no damage handling: the floor a file tier's TTFT can reach, which
PersistingConnector is measured against. Jobs run synchronously inside ``submit_*``.
Configured with ``spec_name: NaiveFileSpec``, ``spec_module_path: naive_file_spec`` and
``naive_dir`` in ``kv_connector_extra_config`` (the module must be importable: the engine
kit puts ``benchmarks/`` on ``sys.path``). Runs inside a vLLM engine only.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    RequestOffloadingContext,
    TransferResult,
)


class Paths(LoadStoreSpec):
    """The files of a job's blocks, in vLLM's block order (sent to the worker process)."""

    def __init__(self, paths: list[str]):
        self.paths = paths


class NaiveManager(OffloadingManager):
    def __init__(self, root: str):
        self.root = root

    def path(self, key: bytes) -> str:
        return os.path.join(self.root, key.hex())

    def lookup(self, key: Any, req_context: Any) -> Any:
        return LookupResult.HIT if os.path.exists(self.path(key)) else LookupResult.MISS

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        return Paths([self.path(k) for k in keys])

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        new = [k for k in keys if not os.path.exists(self.path(k))]
        return PrepareStoreOutput(new, Paths([self.path(k) for k in new]), [])

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()


class NaiveWorker(OffloadingWorker):
    def __init__(self, kv_caches: Any):
        refs = kv_caches.group_data_refs[0]
        self.rows = [
            (kv_caches.tensors[r.tensor_idx].tensor.numpy(), r.page_size_bytes) for r in refs
        ]
        self.done: list[TransferResult] = []

    def views(self, block: int) -> list[memoryview]:
        return [t[block, :n].data for t, n in self.rows]

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        for block, path in zip(src_spec.block_ids, dst_spec.paths, strict=True):
            with open(path + ".tmp", "wb") as f:
                for view in self.views(int(block)):
                    f.write(view)
            os.replace(path + ".tmp", path)
        self.done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        for path, block in zip(src_spec.paths, dst_spec.block_ids, strict=True):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, self.views(int(block)), 0)
            finally:
                os.close(fd)
        self.done.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: Any) -> None:
        return None


class NaiveFileSpec(OffloadingSpec):
    def __init__(self, config: Any):
        super().__init__(config)
        self.root = str(self.extra_config["naive_dir"])
        os.makedirs(self.root, exist_ok=True)

    def get_manager(self) -> OffloadingManager:
        return NaiveManager(self.root)

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        return NaiveWorker(kv_caches)
