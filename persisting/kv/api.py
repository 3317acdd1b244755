"""The KV API contract, written once: what ``KVStore``, ``KVCacheClient`` and
``SyncKVCacheClient`` have in common, and the two helpers that derive one side of a
sync/async pair from the other.

* :class:`KVApi` is the blocking contract (:class:`~persisting.kv.KVStore`,
  :class:`~persisting.service.SyncKVCacheClient`); :class:`AsyncKVApi` is the same
  contract awaited (:class:`~persisting.service.KVCacheClient`). Code written against one
  of them runs in-process or against the service unchanged. The three classes inherit the
  protocol they implement, so mypy checks each of their signatures against it.
* :class:`in_thread` makes an async method out of a blocking one (``aput =
  in_thread(put)``: the in-process store's async mirror), :class:`through_loop` a blocking
  method out of an async client's (``put = through_loop(KVCacheClient.put)``: the sync
  client). Both keep the wrapped method's parameters visible to type checkers, so a mirror
  cannot drift from its original.

Where the implementations differ, the method's docstring here says how. Methods outside the
contract (``KVStore.lease``/``touch``/``shared_location``/``flush``, the client's
``member_of``/``members``, the store's put options ``chain``/``on_complete``) belong to one
side only.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine, Sequence
from typing import (
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
    runtime_checkable,
)

import numpy as np

from persisting.kv.keys import TokenHasher
from persisting.kv.layout import Layout
from persisting.kv.paths.puts import PutResult
from persisting.kv.paths.tiers import KeyLike

P = ParamSpec("P")
R = TypeVar("R")
Owner = TypeVar("Owner")
Client_co = TypeVar("Client_co", covariant=True)

#: Keys of a prefix, or one key list per tensor-parallel rank.
PrefixKeys = Sequence[KeyLike] | Sequence[Sequence[KeyLike]]
#: Token ids of a prompt.
Tokens = Sequence[int] | np.ndarray

#: The contract's methods, in the order the protocols declare them.
CONTRACT: tuple[str, ...] = (
    "put",
    "batched_put",
    "get",
    "batched_get",
    "get_into",
    "layout",
    "contains",
    "batched_contains",
    "lookup_prefix",
    "lookup_tokens",
    "remove",
    "batched_remove",
    "pin",
    "unpin",
    "prefetch",
    "stats",
    "close",
)


@runtime_checkable
class KVApi(Protocol):
    """The KV store's API, blocking. Keys are :class:`~persisting.kv.ChunkKey` objects or
    their string form; a malformed key, or one of another model, is an
    :class:`~persisting.errors.InvalidKeyError`. Values come back as the kind they were put
    as (torch tensor, numpy array, bytes), bit-exact; a miss is ``None``.
    """

    def put(
        self,
        key: KeyLike,
        value: Any,
        *,
        fmt: str = "KV_2LTD",
        parent: KeyLike | None = None,
        check_shape: bool = True,
    ) -> PutResult:
        """Store one value. When it counts as stored depends on the store's durability
        (in-process) or the owner's (service). Keys are content addresses: putting a key
        that is present changes nothing (the result says ``stored=False``).
        ``check_shape=False`` skips the format's shape rule and the key's dtype check, for
        layouts another system owns."""
        ...

    def batched_put(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        *,
        fmt: str = "KV_2LTD",
        parents: Sequence[KeyLike | None] | None = None,
        check_shape: bool = True,
    ) -> list[PutResult]:
        """Store a batch; one result per key. The service commits once per owner."""
        ...

    def get(self, key: KeyLike, *, expect: Layout | None = None) -> Any:
        """The value, or None on a miss, on a layout other than ``expect``, or on damage
        (a value that fails its checksum is dropped, never returned)."""
        ...

    def batched_get(self, keys: Sequence[KeyLike], *, expect: Layout | None = None) -> list[Any]:
        """Values of ``keys`` in order, None for each miss (through the service, also for
        keys of a member that is down)."""
        ...

    def get_into(self, key: KeyLike, out: Any, *, expect: Layout | None = None) -> Layout | None:
        """Copy the payload into the writable contiguous buffer ``out`` and return its
        layout; None on a miss. A buffer of another size than the value is an
        :class:`~persisting.errors.InvalidValueError`, and ``out`` is left as it was."""
        ...

    def layout(self, key: KeyLike) -> Layout | None:
        """The stored layout of ``key`` (no payload read), or None."""
        ...

    def contains(self, key: KeyLike) -> bool: ...

    def batched_contains(self, keys: Sequence[KeyLike]) -> list[bool]:
        """One flag per key (the service asks each owner once per batch)."""
        ...

    def lookup_prefix(self, keys: PrefixKeys) -> int:
        """How many leading chunks are present; stops at the first miss. With one key list
        per rank, a chunk counts only if every rank's piece is there."""
        ...

    def lookup_tokens(self, tokens: Tokens, hasher: TokenHasher | None = None) -> int:
        """How many leading tokens are covered by stored chunks, hashed by ``hasher`` or by
        Persisting's own with the store's (the servers') chunk size."""
        ...

    def remove(self, key: KeyLike, *, force: bool = True) -> bool:
        """Drop ``key``; ``force=False`` spares a pinned key. A remove wins over a write of
        the key still in progress. The service removes it from every live member."""
        ...

    def batched_remove(self, keys: Sequence[KeyLike], *, force: bool = True) -> int:
        """How many of ``keys`` were removed."""
        ...

    def pin(self, key: KeyLike) -> bool:
        """Protect ``key`` from eviction until :meth:`unpin`. In-process a pin lasts until
        unpinned; through the service it belongs to the client's session and ends with it."""
        ...

    def unpin(self, key: KeyLike) -> bool: ...

    def prefetch(self, keys: Sequence[KeyLike]) -> int:
        """Load disk hits into the memory tier; how many of ``keys`` are in memory."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters; both shapes carry ``"model"``. In-process: the store's counters and
        tier figures. Through the service: ``"members"`` maps each live member to its
        store's and service's figures, and ``"client"`` holds the client's own counters."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncKVApi(Protocol):
    """:class:`KVApi`, awaited: the same methods, parameters and meaning."""

    async def put(
        self,
        key: KeyLike,
        value: Any,
        *,
        fmt: str = "KV_2LTD",
        parent: KeyLike | None = None,
        check_shape: bool = True,
    ) -> PutResult: ...

    async def batched_put(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        *,
        fmt: str = "KV_2LTD",
        parents: Sequence[KeyLike | None] | None = None,
        check_shape: bool = True,
    ) -> list[PutResult]: ...

    async def get(self, key: KeyLike, *, expect: Layout | None = None) -> Any: ...

    async def batched_get(
        self, keys: Sequence[KeyLike], *, expect: Layout | None = None
    ) -> list[Any]: ...

    async def get_into(
        self, key: KeyLike, out: Any, *, expect: Layout | None = None
    ) -> Layout | None: ...

    async def layout(self, key: KeyLike) -> Layout | None: ...

    async def contains(self, key: KeyLike) -> bool: ...

    async def batched_contains(self, keys: Sequence[KeyLike]) -> list[bool]: ...

    async def lookup_prefix(self, keys: PrefixKeys) -> int: ...

    async def lookup_tokens(self, tokens: Tokens, hasher: TokenHasher | None = None) -> int: ...

    async def remove(self, key: KeyLike, *, force: bool = True) -> bool: ...

    async def batched_remove(self, keys: Sequence[KeyLike], *, force: bool = True) -> int: ...

    async def pin(self, key: KeyLike) -> bool: ...

    async def unpin(self, key: KeyLike) -> bool: ...

    async def prefetch(self, keys: Sequence[KeyLike]) -> int: ...

    async def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class in_thread(Generic[Owner, P, R]):
    """``amethod = in_thread(method)`` in a class body: an async ``amethod`` that runs the
    instance's blocking ``method`` in a worker thread (:func:`asyncio.to_thread`), so the
    event loop keeps running while the store waits on its lock or the disk.

    It calls ``method`` by name on the instance, so a subclass's override is the one run.
    """

    def __init__(self, method: Callable[Concatenate[Owner, P], R]) -> None:
        self._name = method.__name__
        self._attribute = "a" + self._name  # the name it is assigned to (__set_name__)
        self.__signature__ = inspect.signature(method)
        self._bound_signature = _without_self(self.__signature__)
        self.__doc__ = f"Async :meth:`{self._name}`, run in a worker thread."

    def __set_name__(self, owner: type, name: str) -> None:
        self._attribute = name

    def __call__(self, obj: Owner, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        """Called on the class, as a plain method is: ``KVStore.aput(store, ...)``."""
        return self.__get__(obj)(*args, **kwargs)

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> in_thread[Owner, P, R]: ...

    @overload
    def __get__(
        self, obj: Owner, owner: type | None = None
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    def __get__(self, obj: Owner | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        blocking: Callable[P, R] = getattr(obj, self._name)

        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return await asyncio.to_thread(blocking, *args, **kwargs)

        _describe(call, self._attribute, self.__doc__, self._bound_signature)
        return call


class LoopRunner(Protocol[Client_co]):
    """What :class:`through_loop` needs of the blocking facade: the async client it wraps
    and a way to run one of its coroutines to completion on the client's loop."""

    @property
    def client(self) -> Client_co: ...

    def _run(self, coro: Coroutine[Any, Any, R]) -> R: ...


class through_loop(Generic[Owner, P, R]):
    """``method = through_loop(AsyncClient.method)`` in the class body of a blocking facade
    (a :class:`LoopRunner`): a blocking ``method`` that runs the wrapped client's async one
    on the facade's event loop and waits for its result (or exception)."""

    def __init__(self, method: Callable[Concatenate[Owner, P], Coroutine[Any, Any, R]]) -> None:
        self._name = method.__name__
        self.__signature__ = inspect.signature(method)
        self._bound_signature = _without_self(self.__signature__)
        self.__doc__ = method.__doc__

    def __call__(self, obj: LoopRunner[Owner], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Called on the class, as a plain method is: ``SyncKVCacheClient.put(client, ...)``."""
        return self.__get__(obj)(*args, **kwargs)

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> through_loop[Owner, P, R]: ...

    @overload
    def __get__(self, obj: LoopRunner[Owner], owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, obj: LoopRunner[Owner] | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        runner = obj
        awaited: Callable[P, Coroutine[Any, Any, R]] = getattr(runner.client, self._name)

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return runner._run(awaited(*args, **kwargs))

        _describe(call, self._name, self.__doc__, self._bound_signature)
        return call


def _without_self(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _describe(
    function: Callable[..., Any], name: str, doc: str | None, signature: inspect.Signature
) -> None:
    """Give a derived bound method the name, docstring and signature ``help()`` shows
    (a few attribute stores per access: nothing is computed on the call path)."""
    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    function.__signature__ = signature  # type: ignore[attr-defined]


__all__ = [
    "CONTRACT",
    "AsyncKVApi",
    "KVApi",
    "LoopRunner",
    "PrefixKeys",
    "Tokens",
    "in_thread",
    "through_loop",
]
