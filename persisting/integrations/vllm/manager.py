"""The scheduler side on CPU engines: which blocks Persisting holds, which to store, what
was evicted.

vLLM's ``OffloadingConnector`` asks its :class:`OffloadingManager` one block at a time
(``lookup``), then for the load of a request's hits (``prepare_load``) and for the blocks a
step computed (``prepare_store``). The scheduler runs in the engine-core process, the
worker that writes and reads the blocks usually in another (vLLM's CPU executor starts
one), and other engines may share the namespace: so the manager answers from the
namespace's :class:`~persisting.integrations.vllm.catalog.BlockCatalog` (the keys on disk
as of the last rescan plus every store this engine completed, less those whose load
failed). Blocks the worker could not load come back through the connector
(:meth:`PersistingManager.fail`): misses until stored afresh, so a retried request
recomputes them instead of meeting them again. Evicted blocks are reported back to vLLM
(``evicted_keys`` and ``take_events``). Each block to store carries its parent, the block
before it in its request (:mod:`~persisting.integrations.vllm.prefix`), for the
prefix-aware eviction order.

With ``cluster`` the manager answers from a
:class:`~persisting.integrations.vllm.remote.ClusterCatalog` instead, as ``PersistingTier``
does: a block not asked about yet is a ``RETRY`` (vLLM asks again next step), the step's
new keys go to the cluster in one presence question at ``on_schedule_end`` (one round trip
per member, one question in flight), and a block no answer has come for within its wait is a
miss: the scheduler never waits on the network, and a member that does not answer costs a
recompute.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

from persisting.integrations.vllm.catalog import BlockCatalog
from persisting.integrations.vllm.namespace import block_hash_of, block_key
from persisting.integrations.vllm.prefix import chain_parents
from persisting.integrations.vllm.remote import ClusterCatalog
from persisting.integrations.vllm.shared import Namespace, RemoteNamespace

log = logging.getLogger(__name__)

_ANSWERS = {
    "hit": LookupResult.HIT,
    "pending": LookupResult.HIT_PENDING,
    "miss": LookupResult.MISS,
    "retry": LookupResult.RETRY,
}


@dataclass
class PersistingBlocks(LoadStoreSpec):
    """The Persisting keys of the blocks a job loads or stores, in vLLM's block order, and
    (for a store) each one's parent key."""

    keys: list[str]
    parents: list[str | None] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"PersistingBlocks({len(self.keys)} blocks)"


class PersistingManager(OffloadingManager):
    """Answers vLLM's scheduler from the namespace's catalog of stored keys (a local root's,
    or what it learnt of a cluster's)."""

    def __init__(
        self,
        namespace: Namespace | RemoteNamespace,
        dtype: str,
        refresh_interval_s: float,
        spans: dict[int, int],
        release: bool = True,
    ):
        self.namespace = namespace
        self.name = namespace.name
        self.counters = namespace.counters
        self.dtype = dtype
        #: Tokens per offloaded block of each KV-cache group (for each block's parent).
        self.spans = spans
        self._release = release
        self._lock = threading.Lock()
        self._gone: list[str] = []
        self._events: list[OffloadingEvent] = []
        self.catalog: BlockCatalog | ClusterCatalog
        if isinstance(namespace, RemoteNamespace):
            self.catalog = ClusterCatalog(namespace.store, refresh_interval_s, on_gone=self._went)
        else:
            self.catalog = BlockCatalog(namespace.store, refresh_interval_s, on_gone=self._went)
        #: Called at shutdown (the event follower's stop).
        self.on_shutdown: list[Callable[[], None]] = []

    def key(self, key: OffloadKey) -> str:
        return block_key(
            self.name, get_offload_block_hash(key), get_offload_group_idx(key), self.dtype
        )

    def _went(self, texts: list[str]) -> None:
        with self._lock:
            self._gone.extend(texts)

    def refresh(self) -> None:
        """Rescan the namespace now (the catalog also does every ``refresh_interval_s``)."""
        self.catalog.refresh()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            answer = _ANSWERS[self.catalog.lookup(self.key(key))]
        except Exception as exc:  # never into vLLM: a lookup that fails is a miss
            log.warning("Persisting: lookup failed: %s", exc)
            answer = LookupResult.MISS
        if answer is LookupResult.RETRY:  # the cluster is asked at the step's end
            return answer
        if answer is not LookupResult.HIT_PENDING:
            hit = answer is LookupResult.HIT
            self.counters.add(**({"lookup_hits": 1} if hit else {"lookup_misses": 1}))
        return answer

    def on_schedule_end(self, context: object) -> None:
        """The step's new lookups go to the cluster, in one question (cluster only)."""
        if isinstance(self.catalog, ClusterCatalog):
            self.catalog.end_step()

    def has_pending_work(self) -> bool:
        """Whether lookups wait to be asked about, or for their answer (cluster only)."""
        return isinstance(self.catalog, ClusterCatalog) and self.catalog.busy()

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return PersistingBlocks([self.key(k) for k in keys])

    def fail(self, texts: Collection[str]) -> None:
        """The worker could not load these blocks: misses until stored afresh."""
        self.catalog.fail(texts)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        texts = [self.key(k) for k in keys]
        todo = set(self.catalog.claim_stores(texts))
        parents = chain_parents(keys, req_context, self.spans.__getitem__)
        new = [k for k, t in zip(keys, texts, strict=True) if t in todo]
        spec = PersistingBlocks(
            [t for t in texts if t in todo],
            [
                self.key(p) if p is not None else None
                for p, t in zip(parents, texts, strict=True)
                if t in todo
            ],
        )
        return PrepareStoreOutput(keys_to_store=new, store_spec=spec, evicted_keys=self._evicted())

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.catalog.stored([self.key(k) for k in keys], success)
        if success and keys:
            self._events.append(
                OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=False)
            )

    def _evicted(self) -> list[OffloadKey]:
        """Blocks gone since last asked (evicted here, seen gone by a rescan, failed), also
        queued as removal events."""
        evicted: list[str] = []
        if isinstance(self.namespace, Namespace):  # a cluster's members evict on their own
            queue = self.namespace.evicted
            while queue:
                evicted.append(queue.popleft())
        if evicted:
            self.catalog.forget(evicted)  # tells _went
        with self._lock:
            gone, self._gone = self._gone, []
        out = [make_offload_key(*block_hash_of(text)) for text in dict.fromkeys(gone)]
        if out:
            self._events.append(OffloadingEvent(keys=out, medium=Medium.STORAGE, removed=True))
        return out

    def forget(self, texts: Collection[str]) -> None:
        """Blocks removed elsewhere (an evict event): misses from now on, reported evicted."""
        self.catalog.forget(texts)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._evicted()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """vLLM's cache reset forgets what this engine holds in memory; the disk blocks stay
        (other engines may be using them): remove them with ``persisting drop``. Stores in
        flight are dropped by vLLM with their jobs."""
        self.catalog.abandon_stores()

    def shutdown(self) -> None:
        self.catalog.close()
        for hook in self.on_shutdown:
            hook()
        if self._release:
            from persisting.integrations.vllm.shared import release

            self._release = False
            release(self.namespace)


__all__ = ["PersistingBlocks", "PersistingManager"]
