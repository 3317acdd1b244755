"""The worker side: moving blocks between vLLM's KV caches and the namespace's store.

Loads and stores run on a small thread pool so the engine step that submits them is not
held up; vLLM collects them with ``get_finished``. A load reads each block with one
positioned vectored read into the block's rows of vLLM's cache tensors and checks its
checksum (:func:`~persisting.integrations.vllm.blocks.read_rows`). A block that cannot be
loaded -- gone, damaged, laid out differently, an I/O error -- is never left as if loaded:
its destination block id is reported through :meth:`PersistingWorker.take_load_errors`,
which the connector hands to vLLM as ``get_block_ids_with_load_errors`` so the scheduler
recomputes from it (``kv_load_failure_policy="recompute"``). A damaged block is removed
from the store. The job itself reports success either way: vLLM's offloading worker
asserts that every job succeeded.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from persisting.errors import CapacityError, CorruptValueError, PersistingError
from persisting.integrations.vllm.blocks import BlockPages, read_rows
from persisting.integrations.vllm.manager import PersistingBlocks
from persisting.integrations.vllm.shared import Namespace, release
from persisting.kv import PutResult

log = logging.getLogger(__name__)

#: Seconds a load's lease keeps a block's file from being evicted while it is read.
LEASE_S = 60.0


class PersistingWorker(OffloadingWorker):
    """Runs a worker's loads and stores against the namespace's store."""

    def __init__(self, namespace: Namespace, pages: BlockPages, io_threads: int):
        self.namespace = namespace
        self.store = namespace.store
        self.counters = namespace.counters
        self.pages = pages
        # Jobs run on one pool; a load's blocks are read in parallel on the other.
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="persisting-vllm-job")
        self._reads = ThreadPoolExecutor(io_threads, thread_name_prefix="persisting-vllm-read")
        self._lock = threading.Lock()
        self._jobs: dict[int, Future[TransferResult]] = {}
        self._load_errors: set[int] = set()
        self._closed = False

    # -- vLLM's interface -----------------------------------------------------------------

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, PersistingBlocks)
        block_ids = [int(b) for b in dst_spec.block_ids]
        if len(block_ids) != len(src_spec.keys):
            raise ValueError(f"{len(src_spec.keys)} blocks to load into {len(block_ids)} ids")
        self._submit(job_id, self._load, src_spec.keys, block_ids)
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, PersistingBlocks)
        block_ids = [int(b) for b in src_spec.block_ids]
        if len(block_ids) != len(dst_spec.keys):
            raise ValueError(f"{len(dst_spec.keys)} blocks to store from {len(block_ids)} ids")
        # The rows are copied out on the pool: vLLM keeps the blocks until the job is done.
        self._submit(job_id, self._store, dst_spec.keys, block_ids)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done = [job for job, future in self._jobs.items() if future.done()]
            futures = [self._jobs.pop(job) for job in done]
        return [future.result() for future in futures]

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            futures = [self._jobs[j] for j in job_ids if j in self._jobs]
        wait(futures)

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since last asked (for vLLM to recompute)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish the jobs in flight (stores land before the store closes), then let go."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        release(self.namespace)

    # -- the jobs -------------------------------------------------------------------------

    def _submit(self, job_id: int, run: Any, keys: list[str], block_ids: list[int]) -> None:
        future = self._pool.submit(self._timed, job_id, run, keys, block_ids)
        with self._lock:
            self._jobs[job_id] = future

    def _timed(
        self, job_id: int, run: Any, keys: list[str], block_ids: list[int]
    ) -> TransferResult:
        start = time.perf_counter()
        size = run(keys, block_ids)
        return TransferResult(job_id, True, size, time.perf_counter() - start)

    def _load(self, keys: list[str], block_ids: list[int]) -> int:
        """Read a job's blocks, all but the first on the read pool, the first right here."""
        helpers = [
            self._reads.submit(self._load_one, k, b)
            for k, b in zip(keys[1:], block_ids[1:], strict=True)
        ]
        first = self._load_one(keys[0], block_ids[0]) if keys else 0
        return first + sum(h.result() for h in helpers)

    def _load_one(self, key: str, block_id: int) -> int:
        """Load one block into ``block_id``; 0 bytes (and the id reported) on any failure."""
        try:
            size = self._read_block(key, block_id)
        except Exception as exc:  # any failure means: recompute this block
            self._failed(key, block_id, exc)
            return 0
        self.counters.add(blocks_loaded=1, bytes_loaded=size)
        return size

    def _read_block(self, key: str, block_id: int) -> int:
        rows = self.pages.rows(block_id)
        if self.store.in_memory(key):
            value = self.store.get(key)
            if value is not None:
                self.pages.scatter(block_id, value)
                return self.pages.block_bytes
        location = self.store.lease(key, LEASE_S)
        if location is None:
            raise LookupError("not in the store (evicted or removed since the lookup)")
        try:
            shape = tuple(location.layout.shape)
            if location.nbytes != self.pages.block_bytes or shape != self.pages.shape:
                raise CorruptValueError(
                    f"stored block is {location.nbytes} bytes shaped {shape}, this"
                    f" engine's are {self.pages.block_bytes} bytes shaped {self.pages.shape}"
                )
            return read_rows(location.path, location.offset, rows, location.checksum)
        finally:
            self.store.release(key, location.token)

    def _failed(self, key: str, block_id: int, exc: Exception) -> None:
        log.warning("Persisting: block %s not loaded (%s); vLLM recomputes it", key, exc)
        self.counters.add(load_errors=1)
        with self._lock:
            self._load_errors.add(block_id)
        if isinstance(exc, CorruptValueError):
            try:
                self.store.remove(key)  # damaged: the next engine stores it afresh
            except PersistingError as remove_error:
                log.warning("Persisting: cannot remove damaged block %s: %s", key, remove_error)

    def _store(self, keys: list[str], block_ids: list[int]) -> int:
        values = [self.pages.gather(b) for b in block_ids]
        try:
            results = self.store.batched_put(
                keys, values, fmt="binary", chain=True, check_shape=False
            )
        except CapacityError:  # the batch is larger than the budget: one block at a time
            results = [r for k, v in zip(keys, values, strict=True) if (r := self._put_one(k, v))]
        except Exception as exc:  # a failed store is a future miss, never an engine error
            log.warning("Persisting: storing %d blocks failed: %s", len(keys), exc)
            self.counters.add(store_errors=len(keys))
            return 0
        stored = sum(1 for r in results if r.stored)
        size = stored * self.pages.block_bytes
        self.counters.add(blocks_stored=stored, bytes_stored=size)
        return size

    def _put_one(self, key: str, value: Any) -> PutResult | None:
        try:
            return self.store.put(key, value, fmt="binary", check_shape=False)
        except Exception as exc:
            log.warning("Persisting: storing block %s failed: %s", key, exc)
            self.counters.add(store_errors=1)
            return None


__all__ = ["PersistingWorker"]
