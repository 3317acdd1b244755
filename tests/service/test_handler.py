"""The server's control handler over real KV stores, without Pulsing (plain calls):
sessions, pins, index operations, errors. Values move on the data path
(``test_data_path.py``); here they are put into the store directly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from persisting.errors import (
    AccessDeniedError,
    InvalidKeyError,
    InvalidNameError,
    ProtocolError,
    SessionExpiredError,
)
from persisting.kv import KVStore, open_kv_store
from persisting.service.handler import StorageHandler
from persisting.service.protocol import PROTOCOL_VERSION, make_request, unwrap_reply
from tests.service.service_helpers import MODEL, OTHER_MODEL, key, tensor


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    with open_kv_store(
        tmp_path / "root", MODEL, memory_bytes=8 << 20, disk_bytes=64 << 20, max_value_bytes=4 << 20
    ) as s:
        yield s


@pytest.fixture
def handler(store: KVStore, clock: FakeClock) -> Iterator[StorageHandler]:
    h = StorageHandler({MODEL: store}, lease_ttl_s=10.0, clock=clock)
    yield h
    h.close()


def call(
    handler: StorageHandler, op: str, sid: str | None = None, model: str | None = MODEL, **args: Any
) -> Any:
    reply = asyncio.run(handler.handle(make_request(op, sid=sid, model=model, **args)))
    return unwrap_reply(reply)


def hello(handler: StorageHandler) -> str:
    info = call(handler, "hello", client={"pid": 1})
    assert info["models"] == [MODEL]
    return str(info["sid"])


def test_hello_names_the_data_path_with_a_credential_of_the_session(
    handler: StorageHandler,
) -> None:
    handler.data = {"host": "127.0.0.1", "port": 1, "unix": "/x/data.sock", "cert": None}
    a = call(handler, "hello", client={"pid": 1})
    b = call(handler, "hello", client={"pid": 1})
    assert a["data"]["port"] == 1 and a["data"]["unix"] == "/x/data.sock"
    assert a["data"]["id"] != b["data"]["id"] and a["data"]["secret"] != b["data"]["secret"]
    sessions = handler.sessions
    found = sessions.authenticate(a["data"]["id"], a["data"]["secret"])
    assert found is not None and found.sid == a["sid"]
    assert sessions.authenticate(a["data"]["id"], b["data"]["secret"]) is None
    call(handler, "bye", a["sid"])
    assert sessions.authenticate(a["data"]["id"], a["data"]["secret"]) is None


def test_hits_served_from_the_pool_ride_along_and_are_counted(
    handler: StorageHandler, store: KVStore
) -> None:
    sid = hello(handler)
    store.put(key(1), tensor(1, tokens=4, hidden=32))
    before = store.stats().get("get_hit_memory", 0)
    assert call(handler, "contains", sid, keys=[str(key(1))], touch=[str(key(1))] * 3) == [True]
    assert store.stats()["get_hit_memory"] - before == 3
    assert call(handler, "stats", sid)["service"]["get_hits_remembered"] == 3
    # a bad touch never fails the request it rides on
    assert call(handler, "contains", sid, keys=[str(key(1))], touch=["not a key"]) == [True]


def test_pins_of_a_silent_session_expire_after_the_ttl(
    handler: StorageHandler, store: KVStore, clock: FakeClock
) -> None:
    sid = hello(handler)
    store.put(key(9), tensor(9, tokens=4, hidden=32))
    assert call(handler, "pin", sid, keys=[str(key(9))]) == [True]
    assert not store.remove(key(9), force=False)  # pinned in the store
    clock.now += 5
    assert call(handler, "renew", sid) == {"pins": 1}
    clock.now += 9  # 14 s after the pin, 9 s after the renewal: still held
    assert handler.expire_sessions() == 0
    clock.now += 2
    assert handler.expire_sessions() == 1
    assert store.remove(key(9), force=False)  # the pin was given back
    with pytest.raises(SessionExpiredError):
        call(handler, "contains", sid, keys=[str(key(9))])


def test_unpin_takes_back_only_this_sessions_pins(handler: StorageHandler, store: KVStore) -> None:
    a, b = hello(handler), hello(handler)
    store.put(key(10), tensor(10, tokens=4, hidden=32))
    assert call(handler, "pin", a, keys=[str(key(10))]) == [True]
    assert call(handler, "unpin", b, keys=[str(key(10))]) == [False]
    assert call(handler, "bye", b) is True
    assert not store.remove(key(10), force=False)
    assert call(handler, "unpin", a, keys=[str(key(10))]) == [True]
    assert store.remove(key(10), force=False)


def test_models_are_isolated_and_names_checked(handler: StorageHandler) -> None:
    sid = hello(handler)
    with pytest.raises(AccessDeniedError):
        call(handler, "contains", sid, model=OTHER_MODEL, keys=[str(key(1, OTHER_MODEL))])
    with pytest.raises(InvalidNameError):
        call(handler, "contains", sid, model="", keys=[])
    with pytest.raises(InvalidNameError):
        call(handler, "contains", sid, model="bad\x00name", keys=[])
    with pytest.raises(InvalidKeyError):  # a key of another model, sent to this model
        call(handler, "contains", sid, keys=[str(key(1, OTHER_MODEL))])


def test_protocol_mistakes_come_back_as_their_types(handler: StorageHandler) -> None:
    sid = hello(handler)
    reply = asyncio.run(handler.handle({"v": 99, "op": "stats"}))
    with pytest.raises(ProtocolError, match="version"):
        unwrap_reply(reply)
    with pytest.raises(ProtocolError, match="needs a session"):
        call(handler, "contains", None, keys=[str(key(1))])
    with pytest.raises(ProtocolError, match="missing"):
        message = {"v": PROTOCOL_VERSION, "op": "contains", "sid": sid, "model": MODEL}
        unwrap_reply(asyncio.run(handler.handle(message)))


def test_index_operations(handler: StorageHandler, store: KVStore) -> None:
    sid = hello(handler)
    for i in range(3):
        store.put(key(i), tensor(i, tokens=4, hidden=32))
    keys = [str(key(i)) for i in range(5)]
    assert call(handler, "contains", sid, keys=keys) == [True, True, True, False, False]
    assert call(handler, "lookup_prefix", sid, keys=keys) == 3
    assert call(handler, "lookup_prefix", sid, keys=[keys[:3], keys[1:4]]) == 2
    assert call(handler, "prefetch", sid, keys=keys) == 3
    assert call(handler, "layout", sid, keys=keys[:1])[0]["shape"] == [2, 4, 4, 32]
    assert call(handler, "remove", sid, keys=keys[:2]) == [True, True]
    assert call(handler, "lookup_prefix", sid, keys=keys) == 0
    stats = call(handler, "stats", sid)
    assert stats["stores"][MODEL]["prefetched"] == 3
    assert stats["service"]["op_remove"] == 1


def test_token_lookups_are_hashed_by_the_server_and_count_hit_tokens(
    handler: StorageHandler, store: KVStore
) -> None:
    from persisting.kv import TokenHasher

    sid = hello(handler)
    hasher = TokenHasher(MODEL, chunk_size=16)
    tokens = list(range(100))
    keys = [k for _s, _e, k in hasher.process_tokens(tokens)]  # 6 full chunks
    for i, chunk_key in enumerate(keys[:3]):
        store.put(chunk_key, tensor(i, tokens=16, hidden=32))
    before = store.stats().get("lookup_hit_tokens", 0)
    assert call(handler, "lookup_tokens", sid, tokens=tokens, hasher={"chunk_size": 16}) == 48
    assert store.stats()["lookup_hit_tokens"] - before == 48
    with pytest.raises(ProtocolError):
        call(handler, "lookup_tokens", sid, tokens=[1 << 70], hasher={"chunk_size": 16})
    with pytest.raises(ProtocolError):
        call(handler, "lookup_tokens", sid, tokens=tokens, hasher={"model": "x"})
    # The scheme travels with the settings: LMCache's hashes name none of these chunks.
    lmcache = {"chunk_size": 16, "hash_scheme": "lmcache"}
    assert call(handler, "lookup_tokens", sid, tokens=tokens, hasher=lmcache) == 0
    persisting = {"chunk_size": 16, "hash_scheme": "persisting"}
    assert call(handler, "lookup_tokens", sid, tokens=tokens, hasher=persisting) == 48
    with pytest.raises(ProtocolError, match="hash_scheme"):
        call(handler, "lookup_tokens", sid, tokens=tokens, hasher={"hash_scheme": "sha256"})
