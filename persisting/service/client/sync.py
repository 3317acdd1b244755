"""SyncKVCacheClient: the KV-cache client for code without an event loop.

It runs a :class:`~persisting.service.client.KVCacheClient` on an event loop of its own
thread and offers the same methods, blocking (``connect_sync`` is the same as
``SyncKVCacheClient.connect``)::

    client = SyncKVCacheClient.connect(seeds=["127.0.0.1:8610"], model="meta-llama/Llama-3-8B")
    client.put(key, tensor)
    value = client.get(key)
    client.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from persisting.kv import Layout, PutResult, TokenHasher
from persisting.service.client.kv_cache_client import KVCacheClient

T = TypeVar("T")


class SyncKVCacheClient:
    """The same client for code without an event loop: it runs one on its own thread."""

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
        return cls(loop, thread, client)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def put(self, key: Any, value: Any, fmt: str = "KV_2LTD", parent: Any = None) -> PutResult:
        return self._run(self.client.put(key, value, fmt=fmt, parent=parent))

    def batched_put(
        self,
        keys: Sequence[Any],
        values: Sequence[Any],
        fmt: str = "KV_2LTD",
        parents: Sequence[Any] | None = None,
    ) -> list[PutResult]:
        return self._run(self.client.batched_put(keys, values, fmt=fmt, parents=parents))

    def get(self, key: Any, expect: Layout | None = None) -> Any:
        return self._run(self.client.get(key, expect=expect))

    def batched_get(self, keys: Sequence[Any], expect: Layout | None = None) -> list[Any]:
        return self._run(self.client.batched_get(keys, expect=expect))

    def get_into(self, key: Any, out: Any, expect: Layout | None = None) -> Layout | None:
        return self._run(self.client.get_into(key, out, expect=expect))

    def layout(self, key: Any) -> Layout | None:
        return self._run(self.client.layout(key))

    def contains(self, key: Any) -> bool:
        return self._run(self.client.contains(key))

    def lookup_prefix(self, keys: Sequence[Any]) -> int:
        return self._run(self.client.lookup_prefix(keys))

    def lookup_tokens(self, tokens: Any, hasher: TokenHasher | None = None) -> int:
        return self._run(self.client.lookup_tokens(tokens, hasher=hasher))

    def remove(self, key: Any, force: bool = True) -> bool:
        return self._run(self.client.remove(key, force=force))

    def batched_remove(self, keys: Sequence[Any], force: bool = True) -> int:
        return self._run(self.client.batched_remove(keys, force=force))

    def pin(self, key: Any) -> bool:
        return self._run(self.client.pin(key))

    def unpin(self, key: Any) -> bool:
        return self._run(self.client.unpin(key))

    def prefetch(self, keys: Sequence[Any]) -> int:
        return self._run(self.client.prefetch(keys))

    def stats(self) -> dict[str, Any]:
        return self._run(self.client.stats())

    @property
    def members(self) -> list[str]:
        return self.client.members

    def close(self) -> None:
        try:
            self._run(self.client.close())
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


def connect_sync(*args: Any, **kwargs: Any) -> SyncKVCacheClient:
    """:meth:`KVCacheClient.connect` for code without an event loop."""
    return SyncKVCacheClient.connect(*args, **kwargs)


__all__ = ["SyncKVCacheClient", "connect_sync"]
