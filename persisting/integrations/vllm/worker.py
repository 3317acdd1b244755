"""The worker side on CPU engines: moving blocks between vLLM's KV caches and the store.

Loads and stores run on a small thread pool; vLLM collects them with ``get_finished``,
which first waits (up to ``LOAD_WAIT_S``) for the loads the step submitted, so that a
restored request runs in the next step (stores are never waited for). A load reads its
blocks in parallel, each with one positioned vectored read into the block's rows of vLLM's
cache tensors, and checks its checksum (:func:`~persisting.integrations.vllm.blocks.read_rows`).
The pool's threads may run on any CPU of the process (:mod:`.affinity`).

vLLM names the engine's blocks of a job in two ways: 0.32 and 0.33 hand the worker their
block ids (a ``GPULoadStoreSpec``), 0.34 the blocks' addresses (``DevicePointers``: one per
block and cache tensor), which the worker maps back to block ids over the caches it was
given (:class:`DeviceRows`). An expedited load (0.33 and 0.34: a load vLLM waits for within
the step) runs on a thread of its own, never queued behind the other jobs.

A block the scheduler offers may have been stored by another engine sharing the root
after this worker's store last looked: a block this worker does not know is looked up on
disk (the store rescanned, once per load job) before it counts as missing. A block that
cannot be loaded -- gone, damaged, laid out differently, an I/O error -- is never left as
if loaded: the worker reports it to vLLM, which recomputes it
(``kv_load_failure_policy="recompute"``: by block id for a model with one KV-cache group,
by request for several, see the connector), and reports its key to the scheduler, whose
catalog stops offering it until it is stored afresh. A block found on disk but not
loadable is removed from the store, so it is written afresh once recomputed. A load job
reports success either way (0.32 and 0.33's offloading worker asserts that every job
succeeded, and 0.34 ends the engine when a load it waits for within the step fails), unless
its blocks cannot even be told -- then it is failed as a whole: on 0.34 it reports failure,
before that its request is reported (``failed_recving``). A store job that raises reports
failure where vLLM takes one (0.34: ``failed_jobs``, and the blocks are not published).
Whatever a job raises, it finishes: ``get_finished`` never raises, so the worker outlives
any job.

With ``cluster`` a job's blocks move through the cluster's store
(:class:`~persisting.integrations.common.store.EngineStore`) in one batch: a load is one
``read_into`` straight into the blocks' rows of vLLM's cache tensors (checked against the
stored checksum by the client), a store one ``write_from`` of those rows with each block's
parent; each asks every member holding some of the job's blocks once. A block the cluster
does not return (gone, damaged, a member that does not answer) is reported as above, and
a store with a block that failed fails where vLLM takes it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from persisting.errors import CapacityError, CorruptValueError
from persisting.integrations.vllm.affinity import process_cpus, run_on
from persisting.integrations.vllm.blocks import BlockPages, read_rows
from persisting.integrations.vllm.manager import PersistingBlocks
from persisting.integrations.vllm.namespace import block_hash_of
from persisting.integrations.vllm.shared import Namespace, RemoteNamespace, release
from persisting.kv import PutResult

log = logging.getLogger(__name__)

#: Seconds a load's lease keeps a block's file from being evicted while it is read.
LEASE_S = 60.0

#: Seconds ``get_finished`` waits, at most, for the loads submitted since it last ran (a
#: longer load finishes in the background while the engine steps on).
LOAD_WAIT_S = 0.5

#: Whether this vLLM takes a failed job (0.34: ``OffloadingWorkerMetadata.failed_jobs``;
#: before, its offloading worker asserts that every job succeeded).
JOB_FAILURES = "failed_jobs" in getattr(OffloadingWorkerMetadata, "__dataclass_fields__", {})


class DeviceRows:
    """Where vLLM's device pointers point (0.34): for each offloaded KV-cache group, each of
    its cache references' tensor base address and row stride in bytes, as vLLM's
    ``resolve_device_pointers`` computes a block's address (``base + block_id * stride``)."""

    def __init__(self, kv_caches: CanonicalKVCaches, group_ids: list[int]):
        self.groups = group_ids
        self.refs: list[tuple[tuple[int, int], ...]] = []
        for refs in kv_caches.group_data_refs:
            rows = []
            for ref in refs:
                tensor = kv_caches.tensors[ref.tensor_idx].tensor
                rows.append((int(tensor.data_ptr()), int(tensor.stride(0) * tensor.element_size())))
            self.refs.append(tuple(rows))

    def block_ids(self, device: Any) -> tuple[list[int], list[int]]:
        """A job's block ids and its blocks per group, from vLLM's ``DevicePointers``
        (its ``ptrs`` are, group by group, each cache reference's address of each block).
        ValueError for pointers that are not rows of this worker's caches."""
        counts = [int(n) for n in device.group_block_counts]
        refs = [int(n) for n in device.group_data_ref_counts]
        if len(counts) != len(self.refs) or len(refs) != len(self.refs):
            raise ValueError(f"pointers for {len(counts)} groups, {len(self.refs)} offloaded")
        ptrs = np.asarray(device.ptrs, dtype=np.uint64)
        ids: list[int] = []
        at = 0
        for count, nrefs, rows in zip(counts, refs, self.refs, strict=True):
            if count == 0:
                continue
            if nrefs != len(rows):
                raise ValueError(f"{nrefs} cache references for a group of {len(rows)}")
            block = ptrs[at : at + count * nrefs].reshape(nrefs, count)
            at += count * nrefs
            base, stride = rows[0]
            offsets = block[0].astype(np.int64) - base
            if stride <= 0 or (offsets % stride).any():
                raise ValueError("a device pointer is not a row of this worker's KV cache")
            group_ids = offsets // stride
            for (ref_base, ref_stride), pointers in zip(rows, block, strict=True):
                expected = np.uint64(ref_base) + group_ids.astype(np.uint64) * np.uint64(ref_stride)
                if not np.array_equal(pointers, expected):
                    raise ValueError("the device pointers of one block disagree across tensors")
            ids += [int(b) for b in group_ids]
        if at != len(ptrs):
            raise ValueError(f"{len(ptrs)} device pointers, {at} expected")
        return ids, counts


def device_blocks(device: Any, rows: DeviceRows | None) -> tuple[list[int], list[int] | None]:
    """A job's engine block ids and its blocks per group (None: one group), from what vLLM
    hands the worker: a ``GPULoadStoreSpec`` (0.32, 0.33) or ``DevicePointers`` (0.34)."""
    if hasattr(device, "block_ids"):
        sizes = getattr(device, "group_sizes", None)
        return [int(b) for b in device.block_ids], None if sizes is None else list(sizes)
    if hasattr(device, "ptrs") and hasattr(device, "group_block_counts"):
        if rows is None:
            raise ValueError("device pointers, but no KV caches to read them against")
        ids, counts = rows.block_ids(device)
        return ids, counts
    raise ValueError(f"cannot tell a job's blocks from a {type(device).__name__}")


def pair_blocks(
    keys: list[str], block_ids: list[int], group_sizes: list[int] | None, groups: list[int]
) -> list[tuple[str, int, int]]:
    """``(key, group, block id)`` of a job: vLLM lists a job's block ids group by group
    (``group_sizes``, in the order of the offloaded groups ``groups``), and each key names
    its group. ValueError if the two do not match (or a key is not a block's)."""
    sizes = list(group_sizes) if group_sizes is not None else [len(block_ids)]
    if len(sizes) != len(groups):
        raise ValueError(f"{len(sizes)} block groups for {len(groups)} KV-cache groups")
    by_group: dict[int, list[str]] = {g: [] for g in groups}
    for key in keys:
        try:
            group = block_hash_of(key)[1]
        except (IndexError, ValueError):
            raise ValueError(f"{key!r} is not a block's key") from None
        if group not in by_group:
            raise ValueError(f"block {key} of KV-cache group {group}, not offloaded here")
        by_group[group].append(key)
    out: list[tuple[str, int, int]] = []
    at = 0
    for group, size in zip(groups, sizes, strict=True):
        ids = block_ids[at : at + size]
        at += size
        if len(ids) != len(by_group[group]):
            raise ValueError(
                f"{len(by_group[group])} blocks of group {group} for {len(ids)} block ids"
            )
        out += [(key, group, block) for key, block in zip(by_group[group], ids, strict=True)]
    return out


def _pool(threads: int, name: str, cpus: frozenset[int] | None) -> ThreadPoolExecutor:
    """A pool whose threads may run on ``cpus`` (see :mod:`.affinity`)."""
    return ThreadPoolExecutor(
        threads, thread_name_prefix=name, initializer=run_on, initargs=(cpus,)
    )


class _Refresh:
    """Rescans a store at most once per load job, when a block is not found: the first
    caller rescans, the others (the job's other blocks, read at once) wait for it."""

    def __init__(self, namespace: Namespace | RemoteNamespace):
        self._namespace = namespace
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                self._namespace.store.refresh()  # a cluster's: nothing to rescan


class PersistingWorker(OffloadingWorker):
    """Runs a worker's loads and stores against the namespace's store (a local root's, or
    a cluster's)."""

    def __init__(
        self,
        namespace: Namespace | RemoteNamespace,
        pages: dict[int, BlockPages],
        io_threads: int,
        rows: DeviceRows | None = None,
    ):
        self.namespace = namespace
        #: The local root's store (None: a cluster's, ``remote``).
        self.store = namespace.store if isinstance(namespace, Namespace) else None
        self.remote = namespace.store if isinstance(namespace, RemoteNamespace) else None
        self.counters = namespace.counters
        #: Where each offloaded KV-cache group's blocks are, by group id (vLLM's order).
        self.pages = pages
        self.groups = list(pages)
        #: Where vLLM 0.34's device pointers point (None: block ids only).
        self.rows = rows
        # Jobs run on one pool, expedited loads on a thread of their own; a load's blocks
        # are read in parallel on the third. Each thread may run on any of the process's
        # CPUs, not only on the one vLLM bound the creating thread to (see affinity).
        cpus = process_cpus()
        self._pool = _pool(2, "persisting-vllm-job", cpus)
        self._urgent = _pool(1, "persisting-vllm-expedited", cpus)
        self._reads = _pool(io_threads, "persisting-vllm-read", cpus)
        self._lock = threading.Lock()
        self._jobs: dict[int, Future[TransferResult]] = {}
        #: Loads submitted since ``get_finished`` last ran (it waits for them once).
        self._new_loads: list[Future[TransferResult]] = []
        self._failed_blocks: set[int] = set()
        self._failed_keys: list[str] = []
        self._failed_jobs: set[int] = set()
        self._unplaced_jobs: set[int] = set()
        self._closed = False

    # -- vLLM's interface -----------------------------------------------------------------

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """``dst_spec``: the engine blocks to fill (0.32, 0.33: a ``GPULoadStoreSpec``;
        0.34: ``DevicePointers``); ``expedited``: vLLM waits for it within the step."""
        assert isinstance(src_spec, PersistingBlocks)
        future = self._submit(job_id, self._load, src_spec, dst_spec, expedited)
        with self._lock:
            self._new_loads.append(future)
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        """``src_spec``: the engine blocks to store (as ``submit_load``'s ``dst_spec``)."""
        assert isinstance(dst_spec, PersistingBlocks)
        # The rows are copied out on the pool: vLLM keeps the blocks until the job is done.
        self._submit(job_id, self._store, dst_spec, src_spec)
        return True

    def get_finished(self) -> list[TransferResult]:
        """The jobs done since last asked; first waits (up to ``LOAD_WAIT_S``) for the loads
        submitted since then. vLLM's CPU worker asks at the end of the step that submitted
        them, and otherwise goes back to busy-polling its message queue, holding the GIL
        between polls: the load's threads, which take the GIL back after every read, would
        then wait for it over and over (up to the interpreter's switch interval each time)
        while the request that needs the blocks waits for a later step. Waiting here
        releases the GIL and ends the load within the step, as a load read in the step
        would; a longer load ends in the background."""
        with self._lock:
            loads, self._new_loads = self._new_loads, []
        if loads:
            wait(loads, timeout=LOAD_WAIT_S)
        with self._lock:
            done = [job for job, future in self._jobs.items() if future.done()]
            futures = {job: self._jobs.pop(job) for job in done}
        out = []
        for job, future in futures.items():
            error = future.exception()
            if error is None:
                out.append(future.result())
            else:  # not one of the jobs' own errors (they are caught): never raised here
                log.error("Persisting: job %d ended with %r", job, error)
                out.append(TransferResult(job, not JOB_FAILURES, 0, 0.0))
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            futures = [self._jobs[j] for j in job_ids if j in self._jobs]
        wait(futures)

    def take_load_errors(self) -> tuple[set[int], set[int]]:
        """Block ids whose load failed since last asked, and the load jobs they were in
        (for vLLM to recompute: the blocks, or the jobs' requests)."""
        with self._lock:
            blocks, self._failed_blocks = self._failed_blocks, set()
            jobs, self._failed_jobs = self._failed_jobs, set()
        return blocks, jobs

    def take_unplaced_jobs(self) -> set[int]:
        """Load jobs failed as a whole since last asked (their blocks could not be told)
        on a vLLM that takes no failed job: their requests are recomputed instead."""
        with self._lock:
            jobs, self._unplaced_jobs = self._unplaced_jobs, set()
        return jobs

    def take_failed_keys(self) -> list[str]:
        """Keys whose load failed since last asked (for the scheduler's catalog)."""
        with self._lock:
            keys, self._failed_keys = self._failed_keys, []
        return keys

    def shutdown(self) -> None:
        """Finish the jobs in flight (stores land before the store closes), then let go."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._urgent.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        release(self.namespace)

    # -- the jobs -------------------------------------------------------------------------

    def _submit(
        self, job_id: int, run: Any, blocks: PersistingBlocks, device: Any, urgent: bool = False
    ) -> Future[TransferResult]:
        pool = self._urgent if urgent else self._pool
        future = pool.submit(self._timed, job_id, run, blocks, device)
        with self._lock:
            self._jobs[job_id] = future
        return future

    def _timed(
        self, job_id: int, run: Any, blocks: PersistingBlocks, device: Any
    ) -> TransferResult:
        """Run a job; whatever it raises ends it as failed, never the worker."""
        start = time.perf_counter()
        try:
            size, ok = run(job_id, blocks, device)
        except Exception as exc:
            log.warning("Persisting: job %d failed: %r", job_id, exc)
            size, ok = 0, not JOB_FAILURES
        return TransferResult(job_id, ok, size, time.perf_counter() - start)

    def _load(self, job_id: int, blocks: PersistingBlocks, device: Any) -> tuple[int, bool]:
        """Read a job's blocks, all but the first on the read pool, the first right here.
        ``(bytes read, success)``: blocks that fail are reported one by one (the job
        succeeds); a job whose blocks cannot be told fails as a whole."""
        try:
            block_ids, sizes = device_blocks(device, self.rows)
        except Exception as exc:  # where would the blocks go? nothing is loaded
            log.warning("Persisting: load job %d not run: %r", job_id, exc)
            self.counters.add(load_errors=len(blocks.keys))
            with self._lock:
                self._failed_keys.extend(blocks.keys)
                if not JOB_FAILURES:
                    self._unplaced_jobs.add(job_id)
            return 0, not JOB_FAILURES
        try:
            pairs = pair_blocks(blocks.keys, block_ids, sizes, self.groups)
        except ValueError as exc:  # vLLM's spec and ours disagree: nothing is loaded
            self._fail_all(job_id, blocks.keys, block_ids, exc)
            return 0, True
        if self.remote is not None:
            return self._load_remote(job_id, pairs), True
        try:
            refresh = _Refresh(self.namespace)
            helpers = [
                self._reads.submit(self._load_one, job_id, k, g, b, refresh)
                for k, g, b in pairs[1:]
            ]
            first = self._load_one(job_id, *pairs[0], refresh) if pairs else 0
            return first + sum(h.result() for h in helpers), True
        except Exception as exc:  # the read pool shut down, ...: no block counts as loaded
            self._fail_all(job_id, blocks.keys, block_ids, exc)
            return 0, True

    def _load_remote(self, job_id: int, pairs: list[tuple[str, int, int]]) -> int:
        """Read a job's blocks from the cluster, in one batch, into their rows."""
        assert self.remote is not None
        placed: list[tuple[str, int, list[memoryview]]] = []
        for key, group, block_id in pairs:
            try:
                placed.append((key, block_id, self.pages[group].rows(block_id)))
            except Exception as exc:  # not a block of this cache: recompute it
                self._failed(job_id, key, block_id, exc)
        if not placed:
            return 0
        try:
            reads = self.remote.read_into([k for k, _b, _r in placed], [r for *_, r in placed])
        except Exception as exc:  # never into vLLM: every block is recomputed
            reads = ["failed"] * len(placed)
            log.warning("Persisting: load job %d: reading the cluster failed: %s", job_id, exc)
        size = 0
        for (key, block_id, rows), read in zip(placed, reads, strict=True):
            if read == "hit":
                size += sum(len(r) for r in rows)
            else:
                self._failed(job_id, key, block_id, LookupError(f"{read} in the cluster"))
        self.counters.add(blocks_loaded=reads.count("hit"), bytes_loaded=size)
        return size

    def _fail_all(self, job_id: int, keys: list[str], block_ids: list[int], exc: Exception) -> None:
        """Every block of a load job failed (the stored blocks are left as they are)."""
        log.warning("Persisting: load job %d: no block loaded (%s); vLLM recomputes", job_id, exc)
        self.counters.add(load_errors=max(len(keys), len(block_ids)))
        with self._lock:
            self._failed_blocks.update(block_ids)
            self._failed_keys.extend(keys)
            self._failed_jobs.add(job_id)

    def _load_one(self, job_id: int, key: str, group: int, block_id: int, refresh: _Refresh) -> int:
        """Load one block into ``block_id``; 0 bytes (and the block reported) on any failure."""
        try:
            size = self._read_block(key, self.pages[group], block_id, refresh)
        except Exception as exc:  # any failure means: recompute this block
            self._failed(job_id, key, block_id, exc)
            return 0
        self.counters.add(blocks_loaded=1, bytes_loaded=size)
        return size

    def _read_block(self, key: str, pages: BlockPages, block_id: int, refresh: _Refresh) -> int:
        assert self.store is not None
        rows = pages.rows(block_id)
        if self.store.in_memory(key):
            value = self.store.get(key)
            if value is not None:
                pages.scatter(block_id, value)
                return pages.block_bytes
        for last_try in (False, True):
            location = self.store.lease(key, LEASE_S)
            if location is None:
                if last_try:
                    raise LookupError("not in the store (evicted or removed since the lookup)")
                refresh()  # stored by another engine since this store last looked?
                continue
            try:
                shape = tuple(location.layout.shape)
                if location.nbytes != pages.block_bytes or shape != pages.shape:
                    raise CorruptValueError(
                        f"stored block is {location.nbytes} bytes shaped {shape}, this"
                        f" engine's are {pages.block_bytes} bytes shaped {pages.shape}"
                    )
                return read_rows(location.path, location.offset, rows, location.checksum)
            except FileNotFoundError:  # replaced or evicted by another engine meanwhile
                if last_try:
                    raise
                refresh()
            finally:
                self.store.release(key, location.token)
        raise AssertionError("unreachable")

    def _failed(self, job_id: int, key: str, block_id: int, exc: Exception) -> None:
        log.warning("Persisting: block %s not loaded (%s); vLLM recomputes it", key, exc)
        self.counters.add(load_errors=1)
        with self._lock:
            self._failed_blocks.add(block_id)
            self._failed_keys.append(key)
            self._failed_jobs.add(job_id)
        if self.store is not None and not isinstance(exc, LookupError | FileNotFoundError):
            # Damaged, laid out differently, unreadable: removed, so that the block is
            # stored afresh (and offered again) once vLLM has recomputed it.
            try:
                self.store.remove(key)
            except Exception as remove_error:
                log.warning("Persisting: cannot remove block %s: %s", key, remove_error)

    def _store(self, job_id: int, blocks: PersistingBlocks, device: Any) -> tuple[int, bool]:
        """Store a job's blocks: ``(bytes stored, success)``; a job that cannot run, or
        whose batch fails, fails (where vLLM takes it: its blocks are not published)."""
        try:
            block_ids, sizes = device_blocks(device, self.rows)
            pairs = pair_blocks(blocks.keys, block_ids, sizes, self.groups)
        except ValueError as exc:
            log.warning("Persisting: store job %d not run: %s", job_id, exc)
            self.counters.add(store_errors=len(blocks.keys))
            return 0, not JOB_FAILURES
        parent_of = dict(zip(blocks.keys, blocks.parents or [None] * len(blocks.keys), strict=True))
        if self.remote is not None:
            return self._store_remote(pairs, parent_of)
        assert self.store is not None
        keys = [k for k, _g, _b in pairs]
        values = [self.pages[g].gather(b) for _k, g, b in pairs]
        parents = [parent_of[k] for k in keys]
        try:
            results = self.store.batched_put(
                keys, values, fmt="binary", parents=parents, check_shape=False
            )
        except CapacityError:  # the batch is larger than the budget: one block at a time
            results = [
                r
                for k, v, p in zip(keys, values, parents, strict=True)
                if (r := self._put_one(k, v, p))
            ]
        except Exception as exc:  # a failed store is a future miss, never an engine error
            log.warning("Persisting: storing %d blocks failed: %s", len(keys), exc)
            self.counters.add(store_errors=len(keys))
            return 0, not JOB_FAILURES
        group_of = {k: g for k, g, _b in pairs}
        stored = [r for r in results if r.stored]
        size = sum(self.pages[group_of[r.key]].block_bytes for r in stored)
        self.counters.add(blocks_stored=len(stored), bytes_stored=size)
        return size, True

    def _store_remote(
        self, pairs: list[tuple[str, int, int]], parent_of: dict[str, str | None]
    ) -> tuple[int, bool]:
        """Write a job's blocks to the cluster, in one batch, from their rows (vLLM keeps
        them until the job is done); a block that fails fails the job where vLLM takes it."""
        assert self.remote is not None
        keys = [k for k, _g, _b in pairs]
        try:
            writes = self.remote.write_from(
                keys,
                [self.pages[g].rows(b) for _k, g, b in pairs],
                parents=[parent_of[k] for k in keys],
            )
        except Exception as exc:  # a failed store is a future miss, never an engine error
            log.warning("Persisting: storing %d blocks in the cluster failed: %s", len(keys), exc)
            writes = ["failed"] * len(keys)
        stored = [g for (_k, g, _b), w in zip(pairs, writes, strict=True) if w == "stored"]
        size = sum(self.pages[g].block_bytes for g in stored)
        failed = writes.count("failed")
        self.counters.add(blocks_stored=len(stored), bytes_stored=size, store_errors=failed)
        return size, not (failed and JOB_FAILURES)

    def _put_one(self, key: str, value: Any, parent: str | None) -> PutResult | None:
        assert self.store is not None
        try:
            return self.store.put(key, value, fmt="binary", parent=parent, check_shape=False)
        except Exception as exc:
            log.warning("Persisting: storing block %s failed: %s", key, exc)
            self.counters.add(store_errors=1)
            return None


__all__ = ["JOB_FAILURES", "DeviceRows", "PersistingWorker", "device_blocks", "pair_blocks"]
