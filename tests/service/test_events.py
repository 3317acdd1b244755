"""Prewarm/evict event records: building, checking, and a trip through the real Lance queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from actors.kv_events import publish_events
from persisting.config import PersistingSettings
from persisting.errors import InvalidValueError
from persisting.kv import TokenHasher
from persisting.queue import QueueConsumer
from persisting.service.events import evict_event, make_event, parse_event, prewarm_event
from tests.service.service_helpers import MODEL, OTHER_MODEL, key


def test_events_by_key_and_by_tokens() -> None:
    by_key = parse_event(evict_event(MODEL, [key(1), str(key(2))]))
    assert by_key.op == "evict"
    assert by_key.keys() == [str(key(1)), str(key(2))]
    tokens = list(range(600))
    by_tokens = make_event(
        "prewarm", MODEL, tokens=tokens, chunk_size=256, world_size=2, worker_id=1, dtype="half"
    )
    hasher = TokenHasher(MODEL, chunk_size=256, world_size=2, worker_id=1, dtype="half")
    assert by_tokens.keys() == [str(k) for _s, _e, k in hasher.process_tokens(tokens)]
    assert len(by_tokens.keys()) == 2  # the partial chunk is not saved by default
    record = by_tokens.to_record()
    assert record["id"] == MODEL and parse_event(record) == by_tokens
    numpy_tokens = dict(record, tokens=np.arange(600, dtype=np.int64))
    assert parse_event(numpy_tokens).keys() == by_tokens.keys()


def test_token_events_carry_their_hash_scheme() -> None:
    tokens = list(range(600))
    event = make_event("prewarm", MODEL, tokens=tokens, chunk_size=256, hash_scheme="lmcache")
    lmcache = TokenHasher(MODEL, chunk_size=256, scheme="lmcache")
    assert event.keys() == [str(k) for _s, _e, k in lmcache.process_tokens(tokens)]
    assert event.keys()[0].split("@")[3] == "2b763dd00afa89c8"  # LMCache's own key
    record = event.to_record()
    assert record["hash_scheme"] == "lmcache" and parse_event(record) == event
    older = {k: v for k, v in record.items() if k != "hash_scheme"}  # written before schemes
    assert parse_event(older).hash_scheme == "persisting"
    assert parse_event(dict(record, hash_scheme=None)).hash_scheme == "persisting"
    with pytest.raises(InvalidValueError, match="hash_scheme"):
        parse_event(dict(record, hash_scheme="sha256_cbor"))


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"op": "delete", "model": MODEL, "keys": ["x"]}, "op"),
        ({"op": "evict", "model": "", "keys": [str(key(1))]}, "empty"),
        ({"op": "evict", "model": MODEL}, "keys or tokens"),
        ({"op": "evict", "model": MODEL, "keys": ["not-a-key"]}, "not a chunk key"),
        ({"op": "evict", "model": MODEL, "keys": [str(key(1, OTHER_MODEL))]}, "not a key of"),
        ({"op": "evict", "model": MODEL, "tokens": [1.5]}, "ints"),
        ({"op": "evict", "model": MODEL, "tokens": [1], "chunk_size": 0}, "chunk_size"),
        ({"op": "evict", "model": MODEL, "tokens": [1], "dtype": "complex"}, "hasher"),
        ("evict", "dict"),
    ],
)
def test_records_that_are_not_events_are_refused(record: object, match: str) -> None:
    with pytest.raises(InvalidValueError, match=match):
        parse_event(record)  # type: ignore[arg-type]


def test_published_events_come_back_from_the_queue_in_order(tmp_path: Path) -> None:
    settings = PersistingSettings(storage_path=tmp_path / "root", models=[MODEL])
    records = [evict_event(MODEL, [key(1)]), prewarm_event(MODEL, tokens=list(range(512)))]
    assert asyncio.run(publish_events(settings, records)) == 2
    with pytest.raises(InvalidValueError):
        asyncio.run(publish_events(settings, [{"op": "evict", "model": MODEL}]))

    async def read() -> list[dict]:
        consumer = QueueConsumer.open(settings.storage_path, "kv-events", 0, "t")
        try:
            return [r for _o, r in await consumer.poll(10)]
        finally:
            await consumer.close()

    got = [parse_event(r) for r in asyncio.run(read())]
    assert [e.op for e in got] == ["evict", "prewarm"]
    assert got[0].keys() == [str(key(1))]
    assert len(got[1].keys()) == 2


def test_prewarm_helper_publishes_one_checked_event(tmp_path: Path) -> None:
    from actors.kv_events import prewarm

    settings = PersistingSettings(
        storage_path=tmp_path / "root", models=[MODEL], kv={"chunk_size": 16}
    )
    assert prewarm(settings, MODEL, tokens=list(range(40))) == 1
    assert prewarm(settings, MODEL, keys=[key(3)], op="evict") == 1
    with pytest.raises(InvalidValueError):
        prewarm(settings, MODEL, op="drop", keys=[key(3)])

    async def read() -> list[dict]:
        consumer = QueueConsumer.open(settings.storage_path, "kv-events", 0, "t")
        try:
            return [r for _o, r in await consumer.poll(10)]
        finally:
            await consumer.close()

    first, second = (parse_event(r) for r in asyncio.run(read()))
    hasher = TokenHasher(MODEL, chunk_size=16)  # the settings' chunk size is the default
    assert first.keys() == [str(k) for _s, _e, k in hasher.process_tokens(list(range(40)))]
    assert (second.op, second.keys()) == ("evict", [str(key(3))])


def test_prewarm_helper_hashes_with_the_configured_scheme(tmp_path: Path) -> None:
    from actors.kv_events import prewarm

    settings = PersistingSettings(
        storage_path=tmp_path / "root",
        models=[MODEL],
        kv={"chunk_size": 16, "hash_scheme": "lmcache"},
    )
    assert prewarm(settings, MODEL, tokens=list(range(40))) == 1
    assert prewarm(settings, MODEL, tokens=list(range(40)), hash_scheme="persisting") == 1

    async def read() -> list[dict]:
        consumer = QueueConsumer.open(settings.storage_path, "kv-events", 0, "t")
        try:
            return [r for _o, r in await consumer.poll(10)]
        finally:
            await consumer.close()

    configured, explicit = (parse_event(r) for r in asyncio.run(read()))
    assert (configured.hash_scheme, explicit.hash_scheme) == ("lmcache", "persisting")
    lmcache = TokenHasher(MODEL, chunk_size=16, scheme="lmcache")
    assert configured.keys() == [str(k) for _s, _e, k in lmcache.process_tokens(range(40))]
