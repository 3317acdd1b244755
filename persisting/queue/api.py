"""Using the Lance queue: Pulsing registration, topic-aware writers/readers, consumers.

Pulsing gives a bucket's backend ``storage_path=<storage_path>/bucket_<id>``, without the
topic, so :func:`open_writer` and :func:`open_reader` pass
``<root>/queue/<encoded topic>`` and every bucket lands at
``<root>/queue/<topic>/bucket_<id>/data.lance``, the layout of :class:`StorageRoot`.
:func:`open_reader` returns a :class:`TopicReader`, whose ``get(wait=True, timeout=t)``
waits at most ``t`` in all, however many buckets the topic has.

:class:`QueueConsumer` reads one bucket directly (no actor system needed) from its committed
position and commits progress durably, for consumers that must resume where they stopped.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from persisting.config import PersistingSettings
from persisting.errors import ConfigError, OffsetTrimmedError
from persisting.lance_store import StorageRoot
from persisting.pulsing_compat import get_within
from persisting.queue.backend import LanceBackend

if TYPE_CHECKING:
    from pulsing.streaming import QueueReader, QueueWriter
    from pulsing.streaming.sync_queue import SyncQueueReader

logger = logging.getLogger(__name__)

#: Names :func:`register` registers LanceBackend under (the class name too: Pulsing sends a
#: backend class to other nodes by its ``__name__``).
BACKEND_NAMES = ("lance", "persisting", "LanceBackend")


def register() -> tuple[str, ...]:
    """Register LanceBackend with ``pulsing.streaming``; call it in every process of a cluster."""
    from pulsing.streaming import register_backend

    for name in BACKEND_NAMES:
        register_backend(name, LanceBackend)
    return BACKEND_NAMES


def _root(storage_root: str | os.PathLike[str] | None) -> Path:
    if storage_root is None:
        return PersistingSettings.load().storage_path
    return Path(storage_root)


def topic_storage_path(storage_root: str | os.PathLike[str] | None, topic: str) -> str:
    """What to pass to Pulsing as ``storage_path`` for ``topic``: ``<root>/queue/<topic>``."""
    return str(StorageRoot(_root(storage_root)).topic_dir(topic))


async def open_writer(
    system: Any,
    topic: str,
    *,
    storage_root: str | os.PathLike[str] | None = None,
    bucket_column: str = "id",
    num_buckets: int = 4,
    batch_size: int | None = None,
    backend_options: dict[str, Any] | None = None,
) -> QueueWriter:
    """``pulsing.streaming.write_queue`` on the Lance backend under ``storage_root``.

    ``storage_root`` defaults to the settings' ``storage_path``, ``batch_size`` to
    ``queue.batch_size``.
    """
    from pulsing.streaming import write_queue

    register()
    if batch_size is None:
        batch_size = PersistingSettings.load().queue.batch_size
    return await write_queue(
        system,
        topic,
        bucket_column=bucket_column,
        num_buckets=num_buckets,
        batch_size=batch_size,
        storage_path=topic_storage_path(storage_root, topic),
        backend="lance",
        backend_options=backend_options,
    )


class TopicReader:
    """Pulsing's ``QueueReader`` whose ``get(wait=True, timeout=t)`` waits at most ``t`` in all.

    Pulsing's reader visits its buckets one after another and hands each the whole
    ``timeout`` (entry 4 of :mod:`persisting.pulsing_compat`). This reader takes what the
    buckets hold now and, only if that is nothing, looks again every ``poll_interval_s``
    until a record comes or the deadline passes. Everything else (``reset``, ``set_offset``,
    ``queue``, ``bucket_ids``) is the wrapped reader's.
    """

    def __init__(self, reader: QueueReader, *, poll_interval_s: float = 0.05):
        if poll_interval_s <= 0:
            raise ConfigError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self.reader = reader
        self.poll_interval_s = poll_interval_s

    async def get(
        self, limit: int = 100, wait: bool = False, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` records from the assigned buckets, from where this reader stands.

        With ``wait`` and nothing to read, waits for a record: at most ``timeout`` seconds in
        all when it is truthy, for as long as it takes otherwise (as in Pulsing).
        """
        return await get_within(self.reader, limit, wait, timeout, self.poll_interval_s)

    def reset(self) -> None:
        self.reader.reset()

    def set_offset(self, offset: int, bucket_id: int | None = None) -> None:
        self.reader.set_offset(offset, bucket_id)

    def sync(self) -> SyncQueueReader:
        """A blocking twin (Pulsing's ``SyncQueueReader`` over this reader)."""
        from pulsing.streaming.sync_queue import SyncQueueReader

        return SyncQueueReader(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reader, name)


async def open_reader(
    system: Any,
    topic: str,
    *,
    storage_root: str | os.PathLike[str] | None = None,
    bucket_id: int | None = None,
    bucket_ids: list[int] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    num_buckets: int = 4,
    backend_options: dict[str, Any] | None = None,
    poll_interval_s: float = 0.05,
) -> TopicReader:
    """``pulsing.streaming.read_queue`` on the Lance backend under ``storage_root``, as a
    :class:`TopicReader` (a waiting ``get`` looks for records every ``poll_interval_s``)."""
    from pulsing.streaming import read_queue

    register()
    reader = await read_queue(
        system,
        topic,
        bucket_id=bucket_id,
        bucket_ids=bucket_ids,
        rank=rank,
        world_size=world_size,
        num_buckets=num_buckets,
        storage_path=topic_storage_path(storage_root, topic),
        backend="lance",
        backend_options=backend_options,
    )
    return TopicReader(reader, poll_interval_s=poll_interval_s)


def open_bucket(
    storage_root: str | os.PathLike[str] | None, topic: str, bucket_id: int, **options: Any
) -> LanceBackend:
    """One bucket of ``topic`` opened directly: its writer, or a reader with ``read_only=True``."""
    store = StorageRoot(_root(storage_root))
    return LanceBackend(
        bucket_id=bucket_id, storage_path=store.queue_bucket_dir(topic, bucket_id), **options
    )


class QueueConsumer:
    """A named consumer of one bucket that resumes from its committed position.

    :meth:`poll` returns ``(offset, record)`` pairs from the current position on;
    :meth:`commit` durably stores the position after the last polled record (at-least-once:
    what was polled but not committed is read again after a restart). A position that
    retention trimmed away moves to the earliest record (``on_trimmed="earliest"``, counted
    in :attr:`skipped`) or raises OffsetTrimmedError (``on_trimmed="error"``).
    """

    def __init__(
        self,
        backend: LanceBackend,
        name: str,
        *,
        start: Literal["earliest", "latest"] = "earliest",
        on_trimmed: Literal["earliest", "error"] = "earliest",
    ):
        if start not in ("earliest", "latest") or on_trimmed not in ("earliest", "error"):
            raise ConfigError(f"bad start={start!r} or on_trimmed={on_trimmed!r}")
        self.backend = backend
        self.name = name
        self.on_trimmed = on_trimmed
        self.skipped = 0
        committed = backend.positions.get(name)
        if committed is not None:
            self.position = committed
        elif start == "latest":
            self.position = backend.total_count()
        else:
            self.position = backend.earliest_offset()

    @classmethod
    def open(
        cls,
        storage_root: str | os.PathLike[str] | None,
        topic: str,
        bucket_id: int,
        name: str,
        *,
        start: Literal["earliest", "latest"] = "earliest",
        on_trimmed: Literal["earliest", "error"] = "earliest",
        **options: Any,
    ) -> QueueConsumer:
        """A consumer reading ``topic``'s bucket through a read-only backend."""
        options.setdefault("read_only", True)
        backend = open_bucket(storage_root, topic, bucket_id, **options)
        return cls(backend, name, start=start, on_trimmed=on_trimmed)

    async def poll(
        self, max_records: int = 100, *, wait: bool = False, timeout: float | None = None
    ) -> list[tuple[int, dict[str, Any]]]:
        """Up to ``max_records`` records from the position on, advancing it (in memory)."""
        while True:
            try:
                start = self.position
                out: list[tuple[int, dict[str, Any]]] = []
                async for batch in self.backend.get_stream(max_records, start, wait, timeout):
                    out = list(enumerate(batch, start))
                    break  # one batch is enough; the next poll continues
                self.position = start + len(out)
                return out
            except OffsetTrimmedError:
                if self.on_trimmed == "error":
                    raise
                earliest = self.backend.earliest_offset()
                self.skipped += earliest - self.position
                logger.warning(
                    "consumer %r: offsets %d..%d were trimmed before it read them",
                    self.name,
                    self.position,
                    earliest - 1,
                )
                self.position = earliest

    async def commit(self, position: int | None = None) -> None:
        """Durably store ``position`` (default: just after the last polled record)."""
        target = self.position if position is None else position
        await self.backend.commit_position(self.name, target)

    async def close(self) -> None:
        await self.backend.aclose()


__all__ = [
    "BACKEND_NAMES",
    "QueueConsumer",
    "TopicReader",
    "open_bucket",
    "open_reader",
    "open_writer",
    "register",
    "topic_storage_path",
]
