"""The in-process plugin's puts: chunks in flight, the writer pool, completion callbacks.

``batched_submit_put_task`` returns at once; writer threads store each submitted batch in
the Persisting store of its model. While a chunk is in flight its ``MemoryObj`` carries one
extra reference (released when the write finished or failed), a second put of the same
key joins the first, and ``on_complete_callback(key)`` fires once per stored key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj

from persisting.errors import (
    InvalidKeyError,
    InvalidNameError,
    InvalidValueError,
    PersistingError,
    StoreClosedError,
)
from persisting.integrations.lmcache.compat import format_name, tensor_of
from persisting.integrations.lmcache.health import logger
from persisting.kv.api import KVApi

CompletionCallback = Callable[[CacheEngineKey], None]
#: LMCache keys Persisting cannot represent (e.g. a model name with '@'): never stored here.
UNREPRESENTABLE = (InvalidKeyError, InvalidNameError)


@dataclass(frozen=True, slots=True)
class _Put:
    """One chunk being written: its key, key string, parent chunk, object and future."""

    key: CacheEngineKey
    text: str
    parent: str | None
    obj: MemoryObj
    future: Future[None]


class PutWriter:
    """Writes submitted chunks on ``threads`` writer threads; thread-safe.

    ``store_for(model)`` opens (or returns) the store of a model namespace (a local
    :class:`KVStore` or a cluster's client); ``failed(text, error)`` is told of every put
    that failed (after its reference was released); ``text_of(key)`` is a key's string in
    its store.
    """

    def __init__(
        self,
        store_for: Callable[[str], KVApi],
        failed: Callable[[str, BaseException], None],
        threads: int,
        text_of: Callable[[CacheEngineKey], str] = CacheEngineKey.to_string,
    ) -> None:
        self._store_for = store_for
        self._text_of = text_of
        self._failed = failed
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[None]] = {}
        self._closed = False
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="persisting-put")

    def in_flight(self, text: str) -> bool:
        with self._lock:
            return text in self._inflight

    def wait(self) -> None:
        """Block until every put submitted so far has been written (or has failed)."""
        with self._lock:
            pending = list(self._inflight.values())
        for future in pending:
            future.exception()

    def close(self) -> None:
        """Refuse new puts, then wait for the ones in flight."""
        with self._lock:
            self._closed = True
        self.pool.shutdown(wait=True)

    def submit(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        on_complete: CompletionCallback | None,
    ) -> list[Future[None]] | None:
        """See ``PersistingKVBackend.batched_submit_put_task``."""
        if len(keys) != len(objs):
            raise InvalidValueError(f"{len(keys)} keys but {len(objs)} memory objects")
        futures: list[Future[None]] = []
        batch: list[_Put] = []
        already_stored: list[CacheEngineKey] = []
        joined: list[tuple[Future[None], CacheEngineKey]] = []
        texts = self._presence(keys)
        with self._lock:
            if self._closed:
                raise StoreClosedError("PersistingKVBackend is closed")
            previous: tuple[str, str] | None = None  # (model, key string) of the last key
            for key, obj, (text, present) in zip(keys, objs, texts, strict=True):
                same_model = previous is not None and previous[0] == key.model_name
                parent = previous[1] if previous is not None and same_model else None
                previous = (key.model_name, text)
                pending = self._inflight.get(text)
                if pending is not None:
                    futures.append(pending)
                    joined.append((pending, key))
                    continue
                if isinstance(present, BaseException):
                    futures.append(self._refused(text, present))
                    previous = None  # never a parent: it cannot be stored
                    continue
                if present:
                    already_stored.append(key)
                    continue
                future: Future[None] = Future()
                future.set_running_or_notify_cancel()
                self._inflight[text] = future
                obj.ref_count_up()
                batch.append(_Put(key, text, parent, obj, future))
                futures.append(future)
            if batch:
                self.pool.submit(self._write, batch, on_complete)
        if on_complete is not None:
            for pending, key in joined:
                pending.add_done_callback(_after_success(on_complete, key))
        for key in already_stored:
            _notify(on_complete, key)
        return futures or None

    def _presence(self, keys: Sequence[CacheEngineKey]) -> list[tuple[str, bool | BaseException]]:
        """Each key's string and whether it is stored: one batched question per model (a
        cluster asks each member holding some of them once); a key that cannot be stored,
        its error instead; a store that does not answer: not stored (the put says)."""
        out: list[tuple[str, bool | BaseException]] = []
        by_model: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            try:
                out.append((self._text_of(key), False))
                by_model.setdefault(key.model_name, []).append(i)
            except UNREPRESENTABLE as exc:
                out.append((key.to_string(), exc))
        for model, share in by_model.items():
            flags: list[bool | BaseException]
            try:
                flags = list(self._store_for(model).batched_contains([out[i][0] for i in share]))
            except UNREPRESENTABLE as exc:
                flags = [exc] * len(share)
            except StoreClosedError:
                raise
            except Exception as exc:
                logger.warning("Persisting: asking which chunks are stored failed: %s", exc)
                continue
            for i, flag in zip(share, flags, strict=True):
                out[i] = (out[i][0], flag)
        return out

    def _refused(self, text: str, exc: BaseException) -> Future[None]:
        """A failed future for a put that cannot even start (its key is unrepresentable)."""
        self._failed(text, exc)
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        future.set_exception(exc)
        return future

    def _write(self, batch: list[_Put], on_complete: CompletionCallback | None) -> None:
        """Writer thread: store one submitted batch, then release and report every key."""
        outcomes: list[BaseException | None] = [None] * len(batch)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, put in enumerate(batch):
            groups.setdefault((put.key.model_name, format_name(put.obj.metadata.fmt)), []).append(i)
        for (model, fmt), members in groups.items():
            try:
                self._write_group(model, fmt, [batch[i] for i in members], members, outcomes)
            except Exception as exc:  # an I/O failure must not leak references or futures
                for i in members:
                    outcomes[i] = exc
        for put, outcome in zip(batch, outcomes, strict=True):
            put.obj.ref_count_down()
            with self._lock:
                self._inflight.pop(put.text, None)
            if outcome is None:
                put.future.set_result(None)
                _notify(on_complete, put.key)
            else:
                self._failed(put.text, outcome)
                put.future.set_exception(outcome)

    def _write_group(
        self,
        model: str,
        fmt: str,
        items: list[_Put],
        positions: list[int],
        outcomes: list[BaseException | None],
    ) -> None:
        """Store items of one model and format in one batch (one by one if one is bad)."""
        store = self._store_for(model)
        try:
            store.batched_put(
                [put.text for put in items],
                [tensor_of(put.obj) for put in items],
                fmt=fmt,
                # A submitted batch is one request's chunks in order: each one's parent is
                # the chunk submitted before it (prefix-aware eviction drops suffixes first).
                parents=[put.parent for put in items],
                check_shape=False,  # LMCache owns its layouts: kept as they are
            )
            return
        except PersistingError as exc:
            if len(items) == 1:
                outcomes[positions[0]] = exc
                return
        for put, pos in zip(items, positions, strict=True):
            try:
                store.put(
                    put.text, tensor_of(put.obj), fmt=fmt, parent=put.parent, check_shape=False
                )
            except Exception as exc:
                outcomes[pos] = exc


def _notify(callback: CompletionCallback | None, key: CacheEngineKey) -> None:
    if callback is None:
        return
    try:
        callback(key)
    except Exception:
        logger.exception("on_complete_callback failed for %s", key)


def _after_success(
    callback: CompletionCallback, key: CacheEngineKey
) -> Callable[[Future[None]], None]:
    def done(future: Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            _notify(callback, key)

    return done


__all__ = ["UNREPRESENTABLE", "CompletionCallback", "PutWriter"]
