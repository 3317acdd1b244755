"""Prewarm/evict events: the consumer that applies them through the service, and the producer.

Events travel on a Lance queue topic (``settings.service.event_topic``, default
``kv-events``) under the storage root: ``<root>/queue/kv-events/bucket_<id>/``. The
:class:`EventConsumer` runs beside a storage actor (``serve`` starts it), reads every
bucket of the topic from its committed position, and applies each event through a
:class:`~persisting.service.KVCacheClient` of the served actor -- ``prewarm`` becomes
``prefetch`` (disk hits into the memory tier), ``evict`` becomes ``batched_remove`` (index
and disk) -- never through a second store opened on the side. With several storage nodes
the client routes each key to its owner, so one consumer serves the whole cluster.

It commits its position after each applied batch (at-least-once; both operations are
idempotent), so a restarted consumer resumes where it stopped instead of replaying the
topic. A batch that cannot be applied (no server reachable) is retried, not skipped; a
record that is not a valid event, or names a model this server does not serve, is counted
and skipped.

:func:`publish_events` and :func:`prewarm` are the producer side (``persisting prewarm``).
Only one process at a time may write a bucket (the queue's writer lock): the producer
opens the bucket, appends, flushes and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

from actors.ownership import consumer_name as default_consumer_name
from persisting.config import PersistingSettings
from persisting.errors import PersistingError, ServiceUnavailableError, StoreClosedError
from persisting.lance_store import StorageRoot
from persisting.lance_store.ownership import OwnerClaim
from persisting.queue import QueueConsumer, open_bucket
from persisting.service import KVCacheClient
from persisting.service.events import KVEvent, make_event, parse_event

logger = logging.getLogger(__name__)

#: The bucket producers write to: one bucket keeps every event in order.
EVENT_BUCKET = 0


class EventConsumer:
    """Applies a topic's prewarm/evict events through the storage actor ``name``."""

    def __init__(
        self,
        settings: PersistingSettings,
        *,
        name: str | None = None,
        models: Collection[str] | None = None,
        topic: str | None = None,
        consumer_name: str | None = None,
        batch_records: int | None = None,
        poll_interval_s: float = 0.05,
        retry_s: float = 0.5,
        claim: OwnerClaim | None = None,
    ):
        self.settings = settings
        self.name = name or settings.service.name
        #: The namespaces whose events apply here (a server's live table of its stores,
        #: which grows as clients open namespaces on a server started without models).
        self.models: Collection[str] = models if models is not None else set(settings.models)
        self.topic = topic or settings.service.event_topic
        self.consumer_name = consumer_name or default_consumer_name(self.name)
        self.batch_records = batch_records or settings.service.event_batch_records
        self.poll_interval_s = poll_interval_s
        self.retry_s = retry_s
        self.store = StorageRoot(settings.storage_path)
        self.counters: Counter[str] = Counter()
        self.resumed_from: dict[int, int] = {}
        self._consumers: dict[int, QueueConsumer] = {}
        self._clients: dict[str, KVCacheClient] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        #: This process's claim on the consumer (one live process runs it per root).
        self._claim = claim

    @property
    def applied(self) -> int:
        return self.counters["applied"]

    def status(self) -> dict[str, Any]:
        """Counters, where each bucket resumed, and where each one is now."""
        return {
            "topic": self.topic,
            "consumer": self.consumer_name,
            **dict(self.counters),
            "resumed_from": {str(b): p for b, p in self.resumed_from.items()},
            "position": {str(b): c.position for b, c in self._consumers.items()},
        }

    @property
    def running(self) -> bool:
        """Whether the consumer's loop is running (started, not stopped, not crashed)."""
        return self._task is not None and not self._task.done() and not self._stopping

    async def start(self) -> None:
        """Claim the consumer (NamespaceOwnedError, naming the holder, if another live
        process runs it on this root) and start applying events."""
        if self._claim is None:
            self._claim = self.store.claim_consumer(
                self.topic, self.consumer_name, f"event consumer {self.consumer_name!r}"
            )
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        for consumer in self._consumers.values():
            with contextlib.suppress(Exception):
                await consumer.close()
        self._clients.clear()
        self._consumers.clear()
        if self._claim is not None:
            self._claim.release()

    # -- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            try:
                progressed = await self.run_once()
            except asyncio.CancelledError:
                raise
            except (PersistingError, OSError) as exc:
                self.counters["retries"] += 1
                logger.warning("event consumer %r: %s (retrying)", self.consumer_name, exc)
                await asyncio.sleep(self.retry_s)
                continue
            if not progressed:
                await asyncio.sleep(self.poll_interval_s)

    async def run_once(self) -> bool:
        """Apply one batch from each bucket that has records; True if any were applied."""
        self._discover_buckets()
        progressed = False
        for bucket, consumer in sorted(self._consumers.items()):
            start = consumer.position
            polled = await consumer.poll(self.batch_records)
            if not polled:
                continue
            try:
                await self._apply([record for _offset, record in polled])
            except BaseException:
                consumer.position = start  # read the batch again next time
                raise
            await consumer.commit()
            self.counters["batches"] += 1
            progressed = True
            logger.debug("bucket %d: applied offsets %d..%d", bucket, start, consumer.position)
        return progressed

    def _discover_buckets(self) -> None:
        """Open a consumer for every bucket of the topic that exists now."""
        try:
            topic_dir = self.store.topic_dir(self.topic)
            entries = os.listdir(topic_dir)
        except (FileNotFoundError, PersistingError):
            return
        for entry in entries:
            if not entry.startswith("bucket_") or not entry[7:].isdigit():
                continue
            bucket = int(entry[7:])
            if bucket in self._consumers or not (topic_dir / entry / "data.lance").exists():
                continue
            consumer = QueueConsumer.open(
                self.settings.storage_path,
                self.topic,
                bucket,
                self.consumer_name,
                settings=self.settings,
            )
            self._consumers[bucket] = consumer
            self.resumed_from[bucket] = consumer.position
            logger.info(
                "event consumer %r: bucket %d from offset %d",
                self.consumer_name,
                bucket,
                consumer.position,
            )

    async def _apply(self, records: list[dict[str, Any]]) -> None:
        """Apply records in order, merging runs of the same (op, model) into one request."""
        run: list[KVEvent] = []
        for record in records:
            try:
                event = parse_event(record)
            except PersistingError as exc:
                self.counters["invalid"] += 1
                logger.warning("skipping a record that is not an event: %s", exc)
                continue
            if event.model not in self.models:
                self.counters["foreign_model"] += 1
                continue
            if run and (run[-1].op, run[-1].model) != (event.op, event.model):
                await self._apply_run(run)
                run = []
            run.append(event)
        if run:
            await self._apply_run(run)

    async def _apply_run(self, events: list[KVEvent]) -> None:
        op, model = events[0].op, events[0].model
        keys: list[str] = []
        for event in events:
            keys.extend(event.keys())
        client = await self._client(model)
        if not client.members:
            raise ServiceUnavailableError(f"no live {self.name!r} server for {model!r}")
        try:
            if op == "prewarm":
                self.counters["prewarmed_chunks"] += await client.prefetch(keys)
            else:
                self.counters["evicted_chunks"] += await client.batched_remove(keys)
        except (ServiceUnavailableError, StoreClosedError):
            raise  # transient: the batch is read again
        except PersistingError as exc:  # the server refused these events: never retry them
            self.counters["failed"] += len(events)
            logger.warning(
                "event consumer %r: %d %s event(s) failed: %s",
                self.consumer_name,
                len(events),
                op,
                exc,
            )
            return
        self.counters["applied"] += len(events)
        self.counters[f"applied_{op}"] += len(events)

    async def _client(self, model: str) -> KVCacheClient:
        client = self._clients.get(model)
        if client is None:
            client = await KVCacheClient.connect(
                name=self.name, model=model, settings=self.settings, same_host=False
            )
            self._clients[model] = client
        return client


# -- the producer --------------------------------------------------------------------------


async def publish_events(
    settings: PersistingSettings,
    records: Sequence[dict[str, Any] | KVEvent],
    *,
    topic: str | None = None,
    bucket: int = EVENT_BUCKET,
) -> int:
    """Append events to the topic under ``settings.storage_path``; returns how many.

    Each record is checked first (a bad one raises InvalidValueError and nothing is
    written). The records are durable and visible to consumers when this returns.
    """
    checked = [(r if isinstance(r, KVEvent) else parse_event(r)).to_record() for r in records]
    if not checked:
        return 0
    writer = await asyncio.to_thread(
        open_bucket,
        settings.storage_path,
        topic or settings.service.event_topic,
        bucket,
        settings=settings,
    )
    try:
        await writer.put_batch(checked)
        await writer.flush()
    finally:
        await writer.aclose()
    return len(checked)


def prewarm(
    settings: PersistingSettings,
    model: str,
    keys: Sequence[Any] | None = None,
    tokens: Sequence[int] | None = None,
    *,
    op: str = "prewarm",
    topic: str | None = None,
    **hasher: Any,
) -> int:
    """Publish one prewarm (or ``op="evict"``) event; the function behind ``persisting prewarm``.

    ``hasher`` takes ``chunk_size`` (default ``settings.kv.chunk_size``), ``hash_scheme``
    (default ``settings.kv.hash_scheme``), ``world_size``, ``worker_id``, ``dtype`` (default
    ``settings.kv.key_dtype``) and ``save_unfull_chunk`` for events given as tokens.
    """
    hasher.setdefault("chunk_size", settings.kv.chunk_size)
    hasher.setdefault("hash_scheme", settings.kv.hash_scheme)
    hasher.setdefault("dtype", settings.kv.key_dtype)
    event = make_event(op, model, keys, tokens, **hasher)
    return asyncio.run(publish_events(settings, [event], topic=topic))


__all__ = ["EVENT_BUCKET", "EventConsumer", "prewarm", "publish_events"]
