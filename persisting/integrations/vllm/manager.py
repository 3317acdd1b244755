"""The scheduler side: which blocks Persisting holds, which to store, what was evicted.

vLLM's ``OffloadingConnector`` asks its :class:`OffloadingManager` one block at a time
(``lookup``), then for the load of a request's hits (``prepare_load``) and for the blocks a
step computed (``prepare_store``). The scheduler runs in the engine-core process, the
worker that writes and reads the blocks usually in another (vLLM's CPU and GPU executors
start one), and other engines may share the namespace: so the manager answers from a set
of the keys it knows stored -- the namespace's index when it opened, plus every store this
engine completed -- and a background thread rescans the namespace every
``refresh_interval_s`` for blocks others stored and blocks evicted or removed. Evicted
blocks are reported back to vLLM (``evicted_keys`` and ``take_events``). A block that
vanished between a lookup and its load is not a wrong answer: its load fails, and vLLM
recomputes it (see :mod:`persisting.integrations.vllm.worker`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

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

from persisting.integrations.vllm.namespace import block_hash_of, block_key
from persisting.integrations.vllm.shared import Namespace

log = logging.getLogger(__name__)


@dataclass
class PersistingBlocks(LoadStoreSpec):
    """The Persisting keys of the blocks a job loads or stores, in vLLM's block order."""

    keys: list[str]

    def __repr__(self) -> str:
        return f"PersistingBlocks({len(self.keys)} blocks)"


class PersistingManager(OffloadingManager):
    """Answers vLLM's scheduler from the keys known stored in the namespace."""

    def __init__(
        self, namespace: Namespace, dtype: str, refresh_interval_s: float, release: bool = True
    ):
        self.namespace = namespace
        self.store = namespace.store
        self.counters = namespace.counters
        self.dtype = dtype
        self.refresh_interval_s = refresh_interval_s
        self._release = release
        self._lock = threading.Lock()
        self._known: set[str] = {key for key, _size in self.store.stored_keys()}
        self._storing: set[str] = set()
        self._gone: list[str] = []
        self._events: list[OffloadingEvent] = []
        self._stop = threading.Event()
        #: Called at shutdown (the event follower's stop).
        self.on_shutdown: list[Callable[[], None]] = []
        self._refresher = threading.Thread(
            target=self._refresh_loop, name="persisting-vllm-refresh", daemon=True
        )
        self._refresher.start()

    def key(self, key: OffloadKey) -> str:
        return block_key(
            self.store.model, get_offload_block_hash(key), get_offload_group_idx(key), self.dtype
        )

    def _refresh_loop(self) -> None:
        while not self._stop.wait(max(self.refresh_interval_s, 0.05)):
            try:
                self.refresh()
            except Exception as exc:  # a rescan that fails is tried again next time
                log.warning("Persisting: rescanning %s failed: %s", self.store.model, exc)

    def refresh(self) -> None:
        """Rescan the namespace: blocks others stored become hits, vanished ones misses
        (reported to vLLM as evicted)."""
        with self._lock:
            before = set(self._known)
        self.store.refresh()
        now = {key for key, _size in self.store.stored_keys()}
        with self._lock:
            added_meanwhile = self._known - before
            self._known = now | added_meanwhile
            self._gone.extend(before - now - added_meanwhile)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        text = self.key(key)
        with self._lock:
            if text in self._storing:
                return LookupResult.HIT_PENDING
            hit = text in self._known
        self.counters.add(**({"lookup_hits": 1} if hit else {"lookup_misses": 1}))
        return LookupResult.HIT if hit else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return PersistingBlocks([self.key(k) for k in keys])

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Forget loaded blocks whose file is gone: the worker removes a block it found
        damaged, and it must not be offered again until stored afresh."""
        gone = [text for text in map(self.key, keys) if not self._on_disk(text)]
        if gone:
            with self._lock:
                self._known.difference_update(gone)

    def _on_disk(self, text: str) -> bool:
        location = self.store.lease(text, 0.0)  # where its file is (no lease held)
        return location is not None and os.path.exists(location.path)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        new: list[OffloadKey] = []
        texts: list[str] = []
        with self._lock:
            for key in keys:
                text = self.key(key)
                if text in self._storing or text in self._known:
                    continue
                new.append(key)
                texts.append(text)
            self._storing.update(texts)
        return PrepareStoreOutput(
            keys_to_store=new, store_spec=PersistingBlocks(texts), evicted_keys=self._evicted()
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        texts = [self.key(k) for k in keys]
        with self._lock:
            self._storing.difference_update(texts)
            if success:
                self._known.update(texts)
        if success and keys:
            self._events.append(
                OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=False)
            )

    def _evicted(self) -> list[OffloadKey]:
        """Blocks gone since last asked (evicted here or seen gone by a rescan), also
        queued as removal events."""
        with self._lock:
            gone, self._gone = self._gone, []
        queue = self.namespace.evicted
        while queue:
            gone.append(queue.popleft())
        with self._lock:
            self._known.difference_update(gone)
        out = [make_offload_key(*block_hash_of(text)) for text in gone]
        if out:
            self._events.append(OffloadingEvent(keys=out, medium=Medium.STORAGE, removed=True))
        return out

    def forget(self, texts: Collection[str]) -> None:
        """Blocks removed elsewhere (an evict event): misses from now on, reported evicted."""
        with self._lock:
            gone = [t for t in texts if t in self._known]
            self._known.difference_update(gone)
            self._gone.extend(gone)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._evicted()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """vLLM's cache reset forgets what this engine holds in memory; the disk blocks stay
        (other engines may be using them): remove them with ``persisting drop``."""
        self._storing.clear()

    def shutdown(self) -> None:
        self._stop.set()
        for hook in self.on_shutdown:
            hook()
        if self._release:
            from persisting.integrations.vllm.shared import release

            self._release = False
            release(self.namespace)


__all__ = ["PersistingBlocks", "PersistingManager"]
