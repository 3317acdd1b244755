"""SyncKVCacheClient: the KV-cache client for code without an event loop.

It runs a :class:`~persisting.service.client.KVCacheClient` on an event loop of its own
thread and offers the same methods (the contract of :mod:`persisting.kv.api`), blocking
(``connect_sync`` is the same as ``SyncKVCacheClient.connect``)::

    client = SyncKVCacheClient.connect(seeds=["127.0.0.1:8610"], model="meta-llama/Llama-3-8B")
    client.put(key, tensor)
    value = client.get(key)
    client.close()

A client still open when the interpreter exits is closed then (an ``atexit`` hook, given
:data:`EXIT_CLOSE_S` seconds): its sessions end at once, with their pins and leases, instead
of at their TTL, and its loop thread and Pulsing are stopped before finalization.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from persisting.kv.api import KVApi, through_loop
from persisting.service.client.kv_cache_client import KVCacheClient

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How long closing a client left open may take at interpreter exit.
EXIT_CLOSE_S = 10.0
_OPEN: weakref.WeakSet[SyncKVCacheClient] = weakref.WeakSet()


class SyncKVCacheClient(KVApi):
    """The same client for code without an event loop: it runs one on its own thread.

    Its methods are derived from :class:`KVCacheClient`'s by
    :class:`~persisting.kv.api.through_loop`: same parameters, results and errors, without
    ``await``.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: KVCacheClient
    ):
        self._loop = loop
        self._thread = thread
        self.client = client

    @classmethod
    def connect(cls, *args: Any, **kwargs: Any) -> SyncKVCacheClient:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="kv-client-loop", daemon=True)
        thread.start()
        try:
            client = asyncio.run_coroutine_threadsafe(
                KVCacheClient.connect(*args, **kwargs), loop
            ).result()
        except BaseException:
            _stop(loop, thread)
            raise
        sync = cls(loop, thread, client)
        _OPEN.add(sync)
        return sync

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- the contract: each method is the async client's, run to completion on its loop --

    put = through_loop(KVCacheClient.put)
    batched_put = through_loop(KVCacheClient.batched_put)
    get = through_loop(KVCacheClient.get)
    batched_get = through_loop(KVCacheClient.batched_get)
    get_into = through_loop(KVCacheClient.get_into)
    batched_get_into = through_loop(KVCacheClient.batched_get_into)
    layout = through_loop(KVCacheClient.layout)
    contains = through_loop(KVCacheClient.contains)
    batched_contains = through_loop(KVCacheClient.batched_contains)
    lookup_prefix = through_loop(KVCacheClient.lookup_prefix)
    lookup_tokens = through_loop(KVCacheClient.lookup_tokens)
    plan_tokens = through_loop(KVCacheClient.plan_tokens)
    remove = through_loop(KVCacheClient.remove)
    batched_remove = through_loop(KVCacheClient.batched_remove)
    pin = through_loop(KVCacheClient.pin)
    unpin = through_loop(KVCacheClient.unpin)
    prefetch = through_loop(KVCacheClient.prefetch)
    stats = through_loop(KVCacheClient.stats)

    @property
    def members(self) -> list[str]:
        return self.client.members

    @property
    def model(self) -> str:
        return self.client.model

    @property
    def chunk_size(self) -> int:
        """The token chunk size the servers hash this model with."""
        return self.client.chunk_size

    @property
    def key_dtype(self) -> Any:
        """The key dtype token lookups hash with by default (settable, any spelling)."""
        return self.client.key_dtype

    @key_dtype.setter
    def key_dtype(self, dtype: Any) -> None:
        self.client.key_dtype = dtype

    def close(self, timeout_s: float | None = None) -> None:
        """Say goodbye to every member and stop the loop (waiting at most ``timeout_s``
        for the goodbyes, if given)."""
        _OPEN.discard(self)
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(timeout_s)
        finally:
            _stop(self._loop, self._thread)

    def __enter__(self) -> SyncKVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Cancel what still runs on the client's loop, stop it and close it (a loop closed
    with tasks pending prints "Task was destroyed but it is pending!" at exit)."""

    async def cancel_rest() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    if thread.is_alive():
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    if not thread.is_alive():
        loop.close()


def _close_all_at_exit() -> None:
    for client in list(_OPEN):
        try:
            client.close(timeout_s=EXIT_CLOSE_S)
        except (Exception, concurrent.futures.TimeoutError):
            log.warning("closing a KV-cache client at exit failed", exc_info=True)


atexit.register(_close_all_at_exit)


def connect_sync(*args: Any, **kwargs: Any) -> SyncKVCacheClient:
    """:meth:`KVCacheClient.connect` for code without an event loop."""
    return SyncKVCacheClient.connect(*args, **kwargs)


__all__ = ["SyncKVCacheClient", "connect_sync"]
