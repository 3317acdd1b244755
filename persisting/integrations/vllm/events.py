"""Prewarm/evict events for a vLLM namespace, read from the storage root's event topic.

Producers publish events on a Lance queue topic under the storage root (``persisting
prewarm``, or ``actors.kv_events.publish_events``), the same topic a served
store's consumer reads. With ``event_topic`` set, each engine's scheduler runs this
follower: it reads the topic's bucket 0 directly (no Pulsing), keeps the events naming this
namespace's blocks, and applies them on the shared directory:

- ``evict``: the blocks are removed from the namespace (their files unlinked), so every
  engine sharing the root stops offering them; this engine forgets them at once;
- ``prewarm``: the blocks' files are read ahead into the page cache
  (``posix_fadvise(WILLNEED)``), so the next restore of them on this host reads memory.

The consumer's position is committed under one name per namespace (``vllm/<namespace>``),
so engines sharing the root take turns and a restarted engine resumes (at-least-once; both
operations are idempotent). Events naming their blocks by token ids are skipped and
counted: vLLM's block hashes cannot be computed from Persisting's token hash schemes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from persisting.integrations.vllm.shared import Namespace
from persisting.queue import QueueConsumer

log = logging.getLogger(__name__)

#: The bucket event producers write (actors.kv_events.EVENT_BUCKET).
EVENT_BUCKET = 0


def block_keys(record: Mapping[str, Any], namespace: str) -> tuple[str, list[str]] | None:
    """``(op, keys)`` of an event naming blocks of ``namespace``; None for any other record."""
    op, model, keys = record.get("op"), record.get("model"), record.get("keys")
    if op not in ("prewarm", "evict") or model != namespace or not isinstance(keys, list):
        return None
    if record.get("tokens"):  # blocks named by token ids: not vLLM's block hashes
        return None
    return str(op), [k for k in keys if isinstance(k, str) and k.split("@", 1)[0] == namespace]


class EventFollower:
    """A thread applying ``topic``'s events for ``namespace`` until :meth:`stop`."""

    def __init__(
        self,
        namespace: Namespace,
        storage_path: str | os.PathLike[str],
        topic: str,
        forget: Callable[[Sequence[str]], None],
        poll_s: float = 0.2,
    ):
        self.namespace = namespace
        self.store = namespace.store
        self.storage_path = storage_path
        self.topic = topic
        self.forget = forget
        self.poll_s = poll_s
        self.applied = {"evict": 0, "prewarm": 0, "skipped": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="persisting-vllm-events", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.run(self._follow())

    async def _follow(self) -> None:
        consumer: QueueConsumer | None = None
        name = f"vllm/{self.store.model}"
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = QueueConsumer.open(self.storage_path, self.topic, EVENT_BUCKET, name)
                polled = await consumer.poll(256)
                if polled:
                    self.apply([record for _offset, record in polled])
                    await consumer.commit()
                    continue
            except Exception as exc:  # no topic yet, or a read that failed: try again
                log.debug("Persisting: events of %s not read: %s", self.topic, exc)
                if consumer is not None:
                    await consumer.close()
                    consumer = None
            await asyncio.sleep(self.poll_s)
        if consumer is not None:
            await consumer.close()

    def apply(self, records: Sequence[Mapping[str, Any]]) -> None:
        for record in records:
            event = block_keys(record, self.store.model)
            if event is None:
                if record.get("model") == self.store.model:
                    self.applied["skipped"] += 1  # named by token ids, or malformed
                continue
            op, keys = event
            if op == "evict":
                for key in keys:
                    self.store.remove(key)
                self.forget(keys)
                self.namespace.counters.add(events_applied=1)
            else:
                for key in keys:
                    _read_ahead(self.store.lease(key, 0.0))
                self.namespace.counters.add(events_applied=1)
            self.applied[op] += 1


def _read_ahead(location: Any) -> None:
    if location is None:
        return
    try:
        fd = os.open(location.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # gone meanwhile: nothing to warm
    try:
        os.posix_fadvise(fd, location.offset, location.nbytes, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


__all__ = ["EventFollower", "block_keys"]
