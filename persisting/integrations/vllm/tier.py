"""``PersistingTier``: Persisting as a secondary tier of vLLM's tiered offloading.

vLLM's ``TieringOffloadingSpec`` keeps offloaded KV in a CPU tier (its
``CPUPrimaryTierOffloadingManager``: a ``SharedOffloadRegion`` under ``/dev/shm``, one row
per chunk holding every tensor-parallel rank's shard) and cascades every chunk stored
there to its ``secondary_tiers``; a chunk found only in a secondary tier is promoted back
into a row of the CPU tier before the engine loads it. vLLM's own code moves the bytes
between GPU and CPU; a secondary tier only sees the CPU tier's rows. Configured as::

    "secondary_tiers": [{"type": "PersistingTier",
                         "module_path": "persisting.integrations.vllm",
                         "storage_path": "/var/lib/persisting", "disk_bytes": "500GiB"}]

Each chunk is one value of the namespace's KV store: the row, whole (every rank's shard),
written with one pass over the row (hashed while written) and read back with positioned
reads straight into the row, its checksum checked before the promotion is reported. With
``cluster`` in place of ``storage_path`` the namespace (the same name) is on the members of
a ``persisting serve`` cluster instead: see :mod:`~persisting.integrations.vllm.remote`.
Everything vLLM calls runs on its scheduler thread and only queues work or reads memory
(:class:`~persisting.integrations.vllm.catalog.BlockCatalog`); the I/O runs on the tier's
threads. No call raises into vLLM: a failure is a failed job (a store: a future miss; a
load: a failed key, a miss from then on -- see the catalog).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.config import get_current_vllm_config_or_none
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from persisting.integrations.common.opener import open_engine_store
from persisting.integrations.common.store import EngineStore
from persisting.integrations.vllm.catalog import BlockCatalog
from persisting.integrations.vllm.identity import current_engine, engine_namespace
from persisting.integrations.vllm.metrics import serve_metrics, stop_metrics
from persisting.integrations.vllm.namespace import block_hash_of, block_key, key_dtype
from persisting.integrations.vllm.orphan import watch_parent
from persisting.integrations.vllm.prefix import chain_parents
from persisting.integrations.vllm.remote import ClusterCatalog
from persisting.integrations.vllm.settings import tier_settings
from persisting.integrations.vllm.shared import Counters, Namespace, acquire, release

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

    from persisting.kv import KVStore

log = logging.getLogger(__name__)

#: Events kept for vLLM's KV-event publisher between two drains.
_MAX_EVENTS = 1 << 16


class PersistingTier(SecondaryTierManager):
    """A secondary tier of vLLM's tiered offloading over a Persisting KV store namespace."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: str | None = None,
        **options: Any,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = tier_settings(options)
        self.locality = Locality(locality) if locality is not None else None
        config = offloading_spec.config
        self.row_bytes = self.block_size_bytes
        self.num_rows = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        # Built by PersistingConnector, the engine's config is known; configured directly in
        # secondary_tiers, it is vLLM's current config if it set one (else only the
        # offloading config's model name: set model_version then).
        self.namespace_name, describe = engine_namespace(
            config,
            self.settings,
            stored="tier-row",
            vllm_config=current_engine() or get_current_vllm_config_or_none(),
            row_bytes=self.row_bytes,
        )
        self._dtype = key_dtype(config.model.dtype)
        self._spans = {
            g.group_id: g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups
        }
        self._events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._events: deque[OffloadingEvent] = deque(maxlen=_MAX_EVENTS)
        if self.settings.metrics_port is not None:
            serve_metrics(self.settings.metrics_addr, self.settings.metrics_port)
            watch_parent(stop_metrics)  # an engine core whose server died stops
        self.namespace: Namespace | None = None
        self.store: KVStore | None = None
        #: The cluster's namespace (None: a local root's).
        self.remote: EngineStore | None = None
        self.catalog: BlockCatalog | ClusterCatalog
        if self.settings.cluster is not None:
            self.remote = open_engine_store(self.settings, self.namespace_name)
            self.counters = Counters()
            self.catalog = ClusterCatalog(
                self.remote, self.settings.refresh_interval_s, on_gone=self._removed
            )
        else:
            # O_DIRECT: the rows live in vLLM's CPU tier already; the page cache would hold
            # them twice, and copying through it costs more CPU than the copy
            # (persisting.kv.disk.direct_io).
            self.namespace = acquire(
                self.settings, self.namespace_name, describe=describe, direct_io=True
            )
            self.store = self.namespace.store
            self.counters = self.namespace.counters
            self.catalog = BlockCatalog(
                self.store, self.settings.refresh_interval_s, on_gone=self._removed
            )
        # One flat byte view of the CPU tier's rows: each job slices its rows out of it
        # (views, never copies) and lets go of them when done; released at shutdown.
        self._rows = primary_kv_view.cast("B")
        self._pool = ThreadPoolExecutor(
            self.settings.io_threads, thread_name_prefix="persisting-vllm-tier"
        )
        self._lock = threading.Lock()
        self._finished: deque[JobResult] = deque()
        self._running: set[Future[None]] = set()
        self._closed = False

    # -- vLLM's questions (scheduler thread, memory only) ---------------------------------

    def key(self, key: OffloadKey) -> str:
        block, group = get_offload_block_hash(key), get_offload_group_idx(key)
        return block_key(self.namespace_name, block, group, self._dtype)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            answer = self.catalog.lookup(self.key(key))
        except Exception as exc:  # never into vLLM: a lookup that fails is a miss
            log.warning("Persisting: lookup failed: %s", exc)
            return LookupResult.MISS
        if answer == "retry":  # the cluster is asked at the step's end
            return LookupResult.RETRY
        hit = answer == "hit"
        self.counters.add(**({"lookup_hits": 1} if hit else {"lookup_misses": 1}))
        return LookupResult.HIT if hit else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Chunks read from vLLM's CPU tier are recently used here too (off the thread)."""
        texts = [self.key(k) for k in keys]
        self._submit(functools.partial(self._touch, texts))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done: list[JobResult] = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    def has_pending_work(self) -> bool:
        return bool(self._finished) or (
            isinstance(self.catalog, ClusterCatalog) and self.catalog.busy()
        )

    def on_schedule_end(self, context: Any) -> None:
        """The step's new lookups go to the cluster, in one question (cluster only)."""
        if isinstance(self.catalog, ClusterCatalog):
            self.catalog.end_step()

    def take_events(self) -> Iterable[OffloadingEvent]:
        while self._events:
            yield self._events.popleft()

    # -- jobs -----------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a job's chunks for writing. Every key claimed in the catalog here is
        released by the job whatever happens to it (a chunk id out of range, a part that
        cannot run or raises): a key left "being stored" would be a miss for the engine's
        life, and a later store of it would report success and write nothing."""
        job = job_metadata
        todo: set[str] = set()
        try:
            keys = list(job.keys)
            texts = [self.key(k) for k in keys]
            parents = [
                self.key(p) if p is not None else None
                for p in chain_parents(keys, job.req_context, self._spans.__getitem__)
            ]
            chunks = [int(c) for c in job.chunk_ids]
            if len(chunks) != len(texts):
                raise ValueError(f"{len(texts)} keys but {len(chunks)} chunk ids")
            outside = [c for c in chunks if not 0 <= c < self.num_rows]
            if outside:
                raise IndexError(f"chunk {outside[0]} outside the CPU tier's {self.num_rows} rows")
            todo = set(self.catalog.claim_stores(texts))
            items = [(t, c, p) for t, c, p in zip(texts, chunks, parents, strict=True) if t in todo]
            tracker = _Job(job.job_id, keys, texts, len(items), time.perf_counter())
        except Exception as exc:
            log.warning("Persisting: store job %d not started: %s", job.job_id, exc)
            self.catalog.stored(todo, ok=False)
            self._finished.append(JobResult(job.job_id, False))
            return
        if not items:
            self._finish_store(tracker)
            return
        for part in _parts(range(len(items)), self._store_spread()):
            chosen = [items[i] for i in part]
            run = functools.partial(self._store, tracker, chosen)
            self._submit(run, tracker, len(part), claimed=[t for t, _c, _p in chosen])

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        try:
            keys = list(job.keys)
            texts = [self.key(k) for k in keys]
            chunks = [int(c) for c in job.chunk_ids]
        except Exception as exc:
            log.warning("Persisting: load job %d not started: %s", job.job_id, exc)
            self._finished.append(JobResult(job.job_id, False))
            return
        tracker = _Job(job.job_id, keys, texts, len(keys), time.perf_counter(), load=True)
        if not keys:
            self._finish_load(tracker)
            return
        for part in _parts(range(len(keys)), self._spread):
            self._submit(functools.partial(self._load, tracker, part, chunks), tracker, len(part))

    def drain_jobs(self) -> None:
        with self._lock:
            running = list(self._running)
        wait_all(running)

    def on_request_finished(self, req_context: ReqContext) -> None:
        return

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self.catalog.close()
        self._rows.release()  # vLLM releases the CPU tier's view after the tiers' shutdown
        if self.namespace is not None:
            release(self.namespace)
        if self.remote is not None:
            self.remote.close()

    @property
    def _spread(self) -> int:
        """Parts a job is cut into: one per I/O thread on a local root; one on a cluster
        (its one batch asks each member holding some of its chunks once)."""
        return 1 if self.remote is not None else self.settings.io_threads

    def _store_spread(self) -> int:
        """Parts a store job is cut into: as many as the I/O threads left idle, at least
        one (one on a cluster). A part is one batch -- one reservation under the
        directory's usage lock, its files created there, one metadata commit -- written
        one file after another, as vLLM's ``fs`` tier writes a job: a lone job still has
        every thread, and a burst of jobs has a part each, where cutting every job into a
        part per chunk turned the lock into the queue (at 0.5 MiB rows, about a third of
        the throughput, twice the CPU and four times the context switches)."""
        if self.remote is not None:
            return 1
        with self._lock:
            busy = len(self._running)
        return max(1, self.settings.io_threads - busy)

    # -- on the tier's threads ------------------------------------------------------------

    def _submit(
        self,
        run: Callable[[], None],
        job: _Job | None = None,
        size: int = 0,
        claimed: Sequence[str] = (),
    ) -> None:
        """Run ``run`` (``size`` items of ``job``) on the tier's threads; a part that cannot
        run, or raises, fails its job, which still finishes: vLLM waits for every job. The
        ``claimed`` keys of a store part that never runs are released in the catalog here
        (a part that runs reports its keys itself, whatever happens: see ``_store``)."""

        def guarded() -> None:
            try:
                run()
            except Exception as exc:
                log.warning("Persisting: tier job %s failed: %s", job and job.job_id, exc)
                if job is not None:
                    self._part_done(job, False, size)

        try:
            future = self._pool.submit(guarded)
        except RuntimeError:  # shut down
            if claimed:
                self.catalog.stored(claimed, ok=False)
                if job is not None:
                    with self._lock:
                        job.dropped.update(claimed)
            if job is not None:
                self._part_done(job, False, size)
            return
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._running.discard(future)

    def _part_done(self, job: _Job, ok: bool, done: int) -> None:
        """Count ``done`` items of ``job`` finished; the last one reports the job."""
        with self._lock:
            job.failed |= not ok
            job.left -= done
            last = job.left <= 0 and not job.reported
            job.reported |= last
        if not last:
            return
        try:
            (self._finish_load if job.loaded is not None else self._finish_store)(job)
        except Exception as exc:  # whatever happened, vLLM hears of the job
            log.warning("Persisting: tier job %d failed: %s", job.job_id, exc)
            self._finished.append(JobResult(job.job_id, False))

    def _row(self, chunk: int) -> memoryview:
        if not 0 <= chunk < self.num_rows:
            raise IndexError(f"chunk {chunk} outside the CPU tier's {self.num_rows} rows")
        start = chunk * self.row_bytes
        return self._rows[start : start + self.row_bytes]

    def _store(self, job: _Job, items: list[tuple[str, int, str | None]]) -> None:
        """Write some of a job's chunks (one batch: one reservation, one metadata commit).
        The catalog hears how it ended whatever fails (a bad chunk id included)."""
        texts = [t for t, _c, _p in items]
        rows: list[memoryview] = []
        kept: list[str] = []
        try:
            rows.extend(self._row(c) for _t, c, _p in items)
            parents = [p for _t, _c, p in items]
            if self.remote is not None:
                writes = self.remote.write_from(texts, rows, parents=parents)
                stored = writes.count("stored")
                if "failed" not in writes:
                    kept = texts
                else:
                    self.counters.add(store_errors=writes.count("failed"))
            else:
                assert self.store is not None
                results = self.store.batched_put(
                    texts, rows, fmt="binary", parents=parents, check_shape=False
                )
                stored = sum(1 for r in results if r.stored)
                # Stored now or already on disk; a batch over the whole budget keeps its
                # chains' heads only, and the rest are misses vLLM must not hear of.
                kept = [t for t, r in zip(texts, results, strict=True) if r.stored or r.durable]
            self.counters.add(blocks_stored=stored, bytes_stored=stored * self.row_bytes)
        except Exception as exc:  # a full disk, an I/O error: a future miss, never an error
            log.warning("Persisting: storing %d chunks failed: %s", len(items), exc)
            self.counters.add(store_errors=len(items))
        finally:
            for row in rows:
                row.release()
            dropped = set(texts).difference(kept)
            self.catalog.stored(kept, True)
            self.catalog.stored(dropped, False)
        with self._lock:
            job.dropped.update(dropped)
        self._forget_evicted()
        self._part_done(job, not dropped, len(items))

    def _finish_store(self, job: _Job) -> None:
        keys = [k for k, t in zip(job.keys, job.texts, strict=True) if t not in job.dropped]
        if keys and job.count and self._events_on:
            self._events.append(
                OffloadingEvent(
                    keys=keys, medium=Medium.STORAGE, removed=False, locality=self.locality
                )
            )  # fmt: skip
        elapsed = time.perf_counter() - job.start
        self._finished.append(
            JobResult(job.job_id, not job.failed, None, elapsed, job.count * self.row_bytes)
        )

    def _load(self, job: _Job, part: range, chunks: list[int]) -> None:
        """Promote some of a job's chunks, each read straight into its row and checked."""
        assert job.loaded is not None
        if self.remote is not None:
            self._load_remote(job.loaded, part, job.texts, chunks)
        else:
            for i in part:
                job.loaded[i] = self._load_one(job.texts[i], chunks[i])
        self._part_done(job, True, len(part))

    def _load_remote(
        self, loaded: list[bool], part: range, texts: list[str], chunks: list[int]
    ) -> None:
        """Promote a part's chunks from the cluster: one batch read into their rows (a
        member that does not answer: its chunks fail, nothing raises)."""
        assert self.remote is not None
        placed: list[tuple[int, memoryview]] = []
        try:
            for i in part:
                try:
                    placed.append((i, self._row(chunks[i])))
                except IndexError as exc:
                    log.warning("Persisting: chunk %s not promoted: %s", texts[i], exc)
            if not placed:
                return
            reads = self.remote.read_into([texts[i] for i, _r in placed], [r for _i, r in placed])
            for (i, _row), read in zip(placed, reads, strict=True):
                loaded[i] = read == "hit"
        finally:
            for _i, row in placed:
                row.release()

    def _finish_load(self, job: _Job) -> None:
        assert job.loaded is not None
        failed = [t for t, good in zip(job.texts, job.loaded, strict=True) if not good]
        if failed:
            self.catalog.fail(failed)  # before vLLM hears of it: its next lookup misses
        loaded = len(job.texts) - len(failed)
        self.counters.add(
            blocks_loaded=loaded, bytes_loaded=loaded * self.row_bytes, load_errors=len(failed)
        )
        successful = [k for k, good in zip(job.keys, job.loaded, strict=True) if good]
        self._finished.append(
            JobResult(
                job.job_id,
                not failed,
                successful if failed and successful else None,
                time.perf_counter() - job.start,
                loaded * self.row_bytes,
            )
        )

    def _load_one(self, text: str, chunk: int) -> bool:
        try:
            row = self._row(chunk)
        except IndexError as exc:
            log.warning("Persisting: chunk %s not promoted: %s", text, exc)
            return False
        assert self.store is not None
        try:
            layout = self.store.get_into(text, row)
        except Exception as exc:  # unreadable: removed, so it is stored afresh later
            log.warning("Persisting: chunk %s not promoted: %s", text, exc)
            self._remove(text)
            return False
        finally:
            row.release()
        if layout is None:
            log.warning("Persisting: chunk %s not promoted (gone or damaged)", text)
            return False
        return True

    def _remove(self, text: str) -> None:
        assert self.store is not None
        try:
            self.store.remove(text)
        except Exception as exc:
            log.warning("Persisting: cannot remove chunk %s: %s", text, exc)

    def _forget_evicted(self) -> None:
        """Chunks this process's store evicted: misses from now on, reported to vLLM."""
        if self.namespace is None:
            return  # a cluster's members evict on their own
        queue = self.namespace.evicted
        gone: list[str] = []
        while queue:
            try:
                gone.append(queue.popleft())
            except IndexError:
                break
        if gone:
            self.catalog.forget(gone)

    def _touch(self, texts: Sequence[str]) -> None:
        if self.store is None:
            return  # a cluster's members keep their own order
        for text in texts:
            if text in self.catalog:
                self.store.lease(text, 0.0)  # moves it to the recent end of the order

    def _removed(self, texts: list[str]) -> None:
        if not self._events_on:
            return
        keys = [make_offload_key(*block_hash_of(t)) for t in texts]
        self._events.append(
            OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=True, locality=self.locality)
        )


class _Job:
    """A vLLM job split into parts on the tier's threads; reported once all are done.
    ``loaded``: per chunk of a promotion, whether it landed (None for a store)."""

    def __init__(self, job_id: int, keys: list[OffloadKey], texts: list[str], count: int,
                 start: float, *, load: bool = False):  # fmt: skip
        self.job_id = job_id
        self.keys = keys
        self.texts = texts
        self.count = count
        self.start = start
        self.left = count
        self.failed = False
        self.reported = False
        self.loaded: list[bool] | None = [False] * count if load else None
        #: A store's chunks not stored (a failed part, a batch over the budget).
        self.dropped: set[str] = set()


def _parts(indexes: range, most: int) -> list[range]:
    """``indexes`` cut into at most ``most`` consecutive parts of near-equal length."""
    count = max(1, min(most, len(indexes)))
    size = -(-len(indexes) // count)
    return [indexes[i : i + size] for i in range(0, len(indexes), size)]


__all__ = ["PersistingTier"]
