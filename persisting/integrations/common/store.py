"""One interface to the store behind every engine adapter, whether a local root or a
cluster: values move between the store and memory the engine owns (vLLM CPU-tier rows,
SGLang host pages, LMCache memory objects) with :meth:`EngineStore.read_into` and
:meth:`EngineStore.write_from`, a batch at a time, and presence is asked a batch at a time.

A value's destination or source is one writable contiguous buffer, or a sequence of them
(its parts, end to end: a page spread over K and V, or over layers). Values are stored as
``binary`` (their bytes, checksummed): the namespace says what they mean.

Per value, nothing raises: a read says ``"hit"``, ``"miss"``, ``"damaged"`` (a failed
checksum or a stored value of another size: dropped, so it is a miss from then on) or
``"failed"`` (logged); a write says ``"stored"``, ``"present"`` (stored before) or
``"failed"``. A bad call raises at once, before anything moves: a malformed key or one of
another namespace is an :class:`~persisting.errors.InvalidKeyError`, buffers that are not
one per key, not writable or not contiguous an :class:`~persisting.errors.InvalidValueError`.

:class:`LocalStore` is a :class:`~persisting.kv.KVStore` on a root (reads go straight from
the payload file into the engine's buffers under a read lease, hashed as they land); the
cluster's is :class:`~persisting.integrations.common.cluster.ClusterStore`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from persisting.errors import (
    CapacityError,
    CorruptValueError,
    InvalidKeyError,
    InvalidValueError,
    PersistingError,
)
from persisting.kv import Gathered, KVStore, PutResult
from persisting.kv.disk.range_reads import read_file_range
from persisting.kv.keys import key_string

log = logging.getLogger(__name__)

Read = Literal["hit", "miss", "damaged", "failed"]
Write = Literal["stored", "present", "failed"]
#: Seconds a read's lease keeps a value's file from being evicted while it is read.
LEASE_S = 60.0


def parts_of(buffer: Any, writable: bool) -> tuple[memoryview, ...]:
    """``buffer`` (one buffer, or a sequence of parts) as flat byte views."""
    items = buffer if isinstance(buffer, list | tuple) else (buffer,)
    views = []
    for item in items:
        try:
            view = memoryview(item)
        except TypeError:
            raise InvalidValueError(f"a value's buffer, not {type(item).__name__}") from None
        if not view.c_contiguous:
            raise InvalidValueError("a value's buffer must be contiguous")
        if writable and view.readonly:
            raise InvalidValueError("a read needs writable buffers")
        views.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
    return tuple(views)


def outcome(result: PutResult) -> Write:
    if result.stored:
        return "stored"
    return "present" if result.durable and not result.conflict else "failed"


def leading(flags: Sequence[bool]) -> int:
    """How many of ``flags`` from the first are true."""
    return flags.index(False) if False in flags else len(flags)


class EngineStore(ABC):
    """A namespace's values, local or in a cluster (see the module docstring)."""

    #: ``"local"`` or ``"cluster"``.
    kind: str
    #: The namespace every key of this store starts with.
    namespace: str
    #: The typed store underneath, for what values of one binary kind cannot say (an
    #: engine whose values carry their own layout): a :class:`KVStore` or the cluster's
    #: client, both with the calls of :class:`persisting.kv.api.KVApi`.
    kv: Any

    def check_keys(self, keys: Sequence[Any]) -> list[str]:
        texts = [key_string(k) for k in keys]
        for text in texts:
            if text.split("@", 1)[0] != self.namespace:
                raise InvalidKeyError(f"{text!r} is not a key of namespace {self.namespace!r}")
        return texts

    def _views(self, keys: Sequence[Any], buffers: Sequence[Any], writable: bool) -> Any:
        texts = self.check_keys(keys)
        if len(buffers) != len(texts):
            raise InvalidValueError(f"{len(texts)} keys but {len(buffers)} buffers")
        return texts, [parts_of(b, writable) for b in buffers]

    def read_into(self, keys: Sequence[Any], buffers: Sequence[Any]) -> list[Read]:
        """Fill each buffer with its key's value; one outcome per key."""
        texts, views = self._views(keys, buffers, writable=True)
        return self._read(texts, views) if texts else []

    def write_from(
        self,
        keys: Sequence[Any],
        buffers: Sequence[Any],
        parent: Any = None,
        *,
        parents: Sequence[Any] | None = None,
    ) -> list[Write]:
        """Store each buffer's bytes under its key (``keys`` in prefix order, ``parent``
        the key before the first, for eviction by prefix; or ``parents``: each key's own,
        None for none); one outcome per key."""
        texts, views = self._views(keys, buffers, writable=False)
        if parents is not None:
            if len(parents) != len(texts):
                raise InvalidKeyError(f"{len(texts)} keys but {len(parents)} parents")
            chain = [None if p is None else key_string(p) for p in parents]
        else:
            chain = [None if parent is None else key_string(parent), *texts[:-1]]
        return self._write(texts, views, chain) if texts else []

    def exists(self, keys: Sequence[Any]) -> list[bool]:
        """One flag per key, asked in one request per member holding some of them."""
        texts = self.check_keys(keys)
        return self._exists(texts) if texts else []

    def leading(self, keys: Sequence[Any]) -> int:
        """How many of ``keys`` from the first are stored (a prefix's reusable part)."""
        return leading(self.exists(keys))

    @abstractmethod
    def _read(self, keys: list[str], views: list[tuple[memoryview, ...]]) -> list[Read]: ...

    @abstractmethod
    def _write(
        self, keys: list[str], views: list[tuple[memoryview, ...]], parents: list[str | None]
    ) -> list[Write]: ...

    @abstractmethod
    def _exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def remove(self, keys: Sequence[Any]) -> int:
        """Drop ``keys``; how many were stored."""

    def refresh(self) -> None:
        """Pick up values other processes wrote or removed (a cluster's are always seen)."""
        return None

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> EngineStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalStore(EngineStore):
    """A namespace of a local root: a :class:`KVStore`, batches spread over ``io_threads``."""

    kind = "local"

    def __init__(self, store: KVStore, io_threads: int = 4, memory_tier: bool = False):
        self.kv = store
        #: Whether the store has a memory tier (values there may not be on disk yet).
        self.memory_tier = memory_tier
        self.namespace = store.model
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="persisting-engine-io")

    # -- writes ---------------------------------------------------------------------------

    def _write(
        self, keys: list[str], views: list[tuple[memoryview, ...]], parents: list[str | None]
    ) -> list[Write]:
        values = [Gathered(v) for v in views]
        step = -(-len(keys) // self.io_threads)
        spans = [(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
        futures = [
            self._pool.submit(self._put, keys[a:b], values[a:b], parents[a:b]) for a, b in spans
        ]
        return [w for future in futures for w in future.result()]

    def _put(
        self, keys: list[str], values: list[Gathered], parents: list[str | None]
    ) -> list[Write]:
        try:
            results = self.kv.batched_put(
                keys, values, fmt="binary", parents=parents, check_shape=False
            )
        except CapacityError:  # more than the budget at once: one value at a time
            return [self._put_one(k, v, p) for k, v, p in zip(keys, values, parents, strict=True)]
        except Exception as exc:  # a failed write is a future miss, never an engine error
            log.warning("Persisting: storing %d values failed: %s", len(keys), exc)
            return ["failed"] * len(keys)
        return self._present(keys, [outcome(r) for r in results], results)

    def _present(
        self, keys: list[str], writes: list[Write], results: list[PutResult]
    ) -> list[Write]:
        """A key present before, in the memory tier only (not durable yet), is present too;
        a value no tier could take is not (the store is asked which)."""
        unsure = [i for i, r in enumerate(results) if not r.stored and not r.conflict]
        unsure = [i for i in unsure if not results[i].durable]
        if unsure:
            flags = self.kv.batched_contains([keys[i] for i in unsure])
            for i, there in zip(unsure, flags, strict=True):
                writes[i] = "present" if there else "failed"
        return writes

    def _put_one(self, key: str, value: Gathered, parent: str | None) -> Write:
        try:
            return outcome(self.kv.put(key, value, fmt="binary", parent=parent, check_shape=False))
        except Exception as exc:
            log.warning("Persisting: storing %s failed: %s", key, exc)
            return "failed"

    # -- reads ----------------------------------------------------------------------------

    def _read(self, keys: list[str], views: list[tuple[memoryview, ...]]) -> list[Read]:
        futures = [
            self._pool.submit(self._read_one, key, parts)
            for key, parts in zip(keys[1:], views[1:], strict=True)
        ]
        return [self._read_one(keys[0], views[0]), *(f.result() for f in futures)]

    def _read_one(self, key: str, parts: tuple[memoryview, ...]) -> Read:
        try:
            location = self.kv.lease(key, LEASE_S)
        except Exception as exc:
            return self._failed(key, exc)
        if location is None:
            return self._from_memory(key, parts)
        try:
            want = sum(len(p) for p in parts)
            if location.nbytes != want:
                raise CorruptValueError(f"stored value is {location.nbytes} bytes, not {want}")
            digest = read_file_range(location.path, location.offset, parts, hashed=True)
            if digest != location.checksum:
                raise CorruptValueError(f"{location.path}: checksum mismatch")
        except FileNotFoundError:  # evicted by another process since the lease
            return "miss"
        except Exception as exc:
            return self._failed(key, exc)
        finally:
            self._release(key, location.token)
        return "hit"

    def _from_memory(self, key: str, parts: tuple[memoryview, ...]) -> Read:
        """A value only the memory tier holds (written behind, or no disk tier)."""
        if not self.memory_tier:
            return "miss"
        try:
            layout = self.kv.layout(key)
            if layout is None:
                return "miss"
            want = sum(len(p) for p in parts)
            if layout.nbytes != want:
                raise CorruptValueError(f"stored value is {layout.nbytes} bytes, not {want}")
            staging = parts[0] if len(parts) == 1 else bytearray(want)
            if self.kv.get_into(key, staging) is None:
                return "miss"
        except Exception as exc:
            return self._failed(key, exc)
        if len(parts) > 1:
            scatter(memoryview(staging), parts)
        return "hit"

    def _release(self, key: str, token: int) -> None:
        try:
            self.kv.release(key, token)
        except Exception as exc:  # the lease only runs out later
            log.debug("Persisting: releasing %s: %s", key, exc)

    def _failed(self, key: str, exc: Exception) -> Read:
        if isinstance(exc, CorruptValueError):
            log.warning("Persisting: %s is damaged (%s): dropped, the engine recomputes", key, exc)
            try:
                self.kv.remove(key)  # a miss from now on; the next write stores it afresh
            except PersistingError as remove_error:
                log.warning("Persisting: cannot remove damaged %s: %s", key, remove_error)
            return "damaged"
        log.warning("Persisting: %s not read: %s", key, exc)
        return "failed"

    # -- the rest -------------------------------------------------------------------------

    def _exists(self, keys: list[str]) -> list[bool]:
        return self.kv.batched_contains(keys)

    def remove(self, keys: Sequence[Any]) -> int:
        return self.kv.batched_remove(self.check_keys(keys))

    def refresh(self) -> None:
        self.kv.refresh()

    def clear(self) -> int:
        """Remove every value of the namespace (other processes' included)."""
        self.kv.refresh()
        return self.kv.batched_remove([key for key, _size in self.kv.stored_keys()])

    def stats(self) -> dict[str, Any]:
        return self.kv.stats()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.kv.close()


def scatter(source: memoryview, parts: Sequence[memoryview]) -> None:
    """Copy ``source`` into ``parts``, end to end."""
    at = 0
    for part in parts:
        part[:] = source[at : at + len(part)]
        at += len(part)


__all__ = [
    "LEASE_S",
    "EngineStore",
    "LocalStore",
    "Read",
    "Write",
    "leading",
    "parts_of",
    "scatter",
]
