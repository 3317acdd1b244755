"""The server's request handler over real KV stores, without Pulsing (plain calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from persisting.errors import (
    AccessDeniedError,
    CapacityError,
    CorruptValueError,
    InvalidKeyError,
    InvalidNameError,
    ProtocolError,
    SessionExpiredError,
)
from persisting.kv import KVStore, Layout, open_kv_store
from persisting.kv.layout import checksum, decode_value, encode_value
from persisting.service.handler import StorageHandler
from persisting.service.protocol import PROTOCOL_VERSION, make_request, unwrap_reply
from persisting.service.same_host import ClientArena, read_file_into
from persisting.service.sessions import SessionTable
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
    h = StorageHandler({MODEL: store}, lease_ttl_s=10.0, message_part_bytes=64 << 10, clock=clock)
    yield h
    h.close()


def call(
    handler: StorageHandler, op: str, sid: str | None = None, model: str | None = MODEL, **args: Any
) -> Any:
    reply = asyncio.run(handler.handle(make_request(op, sid=sid, model=model, **args)))
    return unwrap_reply(reply)


def hello(handler: StorageHandler, arena: ClientArena | None = None) -> str:
    client: dict[str, Any] = {"pid": 1}
    if arena is not None:
        client["arena"] = {"path": str(arena.path), "size": arena.size, "nonce": arena.nonce}
    info = call(handler, "hello", client=client)
    assert info["models"] == [MODEL]
    assert info["shm"] is (arena is not None)
    return info["sid"]


def put_inline(handler: StorageHandler, sid: str, i: int, value: torch.Tensor) -> dict:
    layout, view = encode_value(value, "KV_2LTD")
    item = {
        "key": str(key(i)),
        "layout": layout.to_dict(),
        "parent": None,
        "checksum": checksum(view),
        "source": {"inline": bytes(view)},
    }
    return call(handler, "put", sid, items=[item], fmt="KV_2LTD")[0]


def test_put_inline_then_get_over_messages_is_bit_exact(handler: StorageHandler) -> None:
    sid = hello(handler)
    value = tensor(1, tokens=4, hidden=32)  # 2 KiB: inline both ways
    result = put_inline(handler, sid, 1, value)
    assert result == {
        "key": str(key(1)),
        "tier": "disk",
        "durable": True,
        "stored": True,
        "conflict": False,
    }
    entry = call(handler, "get", sid, keys=[str(key(1))])[0]
    got = decode_value(
        Layout.from_dict(entry["layout"]), np.frombuffer(entry["data"], np.uint8).copy()
    )
    assert torch.equal(got, value)
    assert entry["checksum"] == checksum(np.frombuffer(entry["data"], np.uint8))
    assert call(handler, "get", sid, keys=[str(key(2))]) == [None]


def test_large_values_move_in_bounded_chunks_both_ways(handler: StorageHandler) -> None:
    sid = hello(handler)
    value = tensor(2, tokens=64, hidden=1024)  # 1 MiB, chunks of 64 KiB
    layout, view = encode_value(value, "KV_2LTD")
    upload = call(handler, "upload_begin", sid, nbytes=layout.nbytes)
    with pytest.raises(ProtocolError):  # a part larger than a chunk is refused
        call(handler, "upload_part", sid, upload=upload, offset=0, data=bytes(view[: 128 << 10]))
    for off in range(0, layout.nbytes, 64 << 10):
        call(
            handler,
            "upload_part",
            sid,
            upload=upload,
            offset=off,
            data=bytes(view[off : off + (64 << 10)]),
        )
    item = {
        "key": str(key(3)),
        "layout": layout.to_dict(),
        "parent": None,
        "checksum": checksum(view),
        "source": {"upload": upload},
    }
    assert call(handler, "put", sid, items=[item], fmt="KV_2LTD")[0]["stored"]
    entry = call(handler, "get", sid, keys=[str(key(3))])[0]
    assert "data" not in entry and entry["checksum"] == checksum(view)
    out = bytearray()
    for off in range(0, layout.nbytes, 64 << 10):
        part = call(
            handler, "read_part", sid, transfer=entry["transfer"], offset=off, length=64 << 10
        )
        assert len(part) <= 64 << 10
        out += part
    assert bytes(out) == bytes(view)
    with pytest.raises(ProtocolError):  # fully read: the transfer is gone
        call(handler, "read_part", sid, transfer=entry["transfer"], offset=0, length=10)
    assert call(handler, "stats", sid)["service"]["staged_bytes"] == 0


def test_a_torn_upload_is_refused_and_not_stored(handler: StorageHandler) -> None:
    sid = hello(handler)
    layout, view = encode_value(tensor(4, tokens=64, hidden=1024), "KV_2LTD")
    upload = call(handler, "upload_begin", sid, nbytes=layout.nbytes)
    call(handler, "upload_part", sid, upload=upload, offset=0, data=bytes(view[: 64 << 10]))
    item = {
        "key": str(key(4)),
        "layout": layout.to_dict(),
        "parent": None,
        "checksum": checksum(view),
        "source": {"upload": upload},
    }
    with pytest.raises(ProtocolError, match="upload has"):
        call(handler, "put", sid, items=[item], fmt="KV_2LTD")
    bad = dict(item, source={"inline": bytes(view[:1000]) + bytes(layout.nbytes - 1000)})
    with pytest.raises(CorruptValueError):
        call(handler, "put", sid, items=[bad], fmt="KV_2LTD")
    assert call(handler, "contains", sid, keys=[str(key(4))]) == [False]


def test_same_host_gets_hand_out_file_locations_under_a_lease(
    handler: StorageHandler, store: KVStore
) -> None:
    arena = ClientArena(4 << 20)
    try:
        sid = hello(handler, arena)
        value = tensor(5, tokens=64, hidden=256)
        put_inline(handler, sid, 5, value)
        entry = call(handler, "get", sid, keys=[str(key(5)), str(key(6))], direct=True)
        assert entry[1] is None
        path, offset, nbytes, digest = entry[0]["file"]
        out = np.empty(nbytes, np.uint8)
        read_file_into(path, offset, memoryview(out))
        assert checksum(out) == digest
        assert torch.equal(decode_value(Layout.from_dict(entry[0]["layout"]), out), value)
        assert call(handler, "stats", sid)["service"]["leases"] == 1
        call(handler, "release", sid, keys=[str(key(5))])
        assert call(handler, "stats", sid)["service"]["leases"] == 0
    finally:
        arena.close()


def test_arena_puts_and_memory_only_gets(tmp_path: Path, clock: FakeClock) -> None:
    # Write-back mode keeps values in memory only: the arena path serves them.
    with open_kv_store(
        tmp_path / "wb", MODEL, memory_bytes=8 << 20, disk_bytes=64 << 20, durability="write_back"
    ) as store:
        handler = StorageHandler({MODEL: store}, clock=clock)
        arena = ClientArena(4 << 20)
        try:
            sid = hello(handler, arena)
            value = tensor(7, tokens=64, hidden=256)
            layout, view = encode_value(value, "KV_2LTD")
            region = arena.allocate(layout.nbytes)
            assert region is not None
            arena.region_view(region)[:] = view
            item = {
                "key": str(key(7)),
                "layout": layout.to_dict(),
                "parent": None,
                "checksum": checksum(view),
                "source": {"arena": region.offset},
            }
            put = call(handler, "put", sid, items=[item], fmt="KV_2LTD", ticket=1)
            assert put[0]["tier"] == "memory"
            arena.region_view(region)[:] = bytes(layout.nbytes)  # the store kept its own copy
            arena.free(region)
            marker = call(handler, "get", sid, keys=[str(key(7))], direct=True)[0]
            assert marker == {"layout": layout.to_dict(), "memory": True}
            region = arena.allocate(layout.nbytes)
            assert region is not None
            got = call(
                handler,
                "get",
                sid,
                keys=[str(key(7))],
                direct=True,
                arena=[region.offset, region.capacity],
                ticket=2,
            )[0]
            assert got["arena"] == region.offset
            copy = np.frombuffer(arena.region_view(region), np.uint8).copy()
            assert torch.equal(decode_value(layout, copy), value)
            with pytest.raises(ProtocolError):  # outside the arena's data area
                call(
                    handler,
                    "put",
                    sid,
                    fmt="KV_2LTD",
                    items=[dict(item, source={"arena": arena.size})],
                    ticket=3,
                )
        finally:
            handler.close()
            arena.close()


def test_expected_layout_that_differs_is_a_miss(handler: StorageHandler) -> None:
    sid = hello(handler)
    put_inline(handler, sid, 8, tensor(8, tokens=4, hidden=32))
    wrong = Layout((2, 4, 4, 16), "bfloat16", "KV_2LTD", 1024).to_dict()
    assert call(handler, "get", sid, keys=[str(key(8))], expect=wrong) == [None]
    assert call(handler, "get", sid, keys=[str(key(8))], expect=wrong, direct=True) == [None]


def test_pins_of_a_silent_session_expire_after_the_ttl(
    handler: StorageHandler, store: KVStore, clock: FakeClock
) -> None:
    sid = hello(handler)
    put_inline(handler, sid, 9, tensor(9, tokens=4, hidden=32))
    assert call(handler, "pin", sid, keys=[str(key(9))]) == [True]
    assert not store.remove(key(9), force=False)  # pinned in the store
    clock.now += 5
    assert call(handler, "renew", sid) == {"pins": 1, "leases": 0}
    clock.now += 9  # 14 s after the pin, 9 s after the renewal: still held
    assert handler.expire_sessions() == 0
    clock.now += 2
    assert handler.expire_sessions() == 1
    assert store.remove(key(9), force=False)  # the pin was given back
    with pytest.raises(SessionExpiredError):
        call(handler, "contains", sid, keys=[str(key(9))])


def test_unpin_takes_back_only_this_sessions_pins(handler: StorageHandler, store: KVStore) -> None:
    a, b = hello(handler), hello(handler)
    put_inline(handler, a, 10, tensor(10, tokens=4, hidden=32))
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


def test_store_limits_and_protocol_mistakes_come_back_as_their_types(
    handler: StorageHandler,
) -> None:
    sid = hello(handler)
    with pytest.raises(CapacityError):
        call(handler, "upload_begin", sid, nbytes=8 << 20)  # max_value_bytes is 4 MiB
    reply = asyncio.run(handler.handle({"v": 99, "op": "stats"}))
    with pytest.raises(ProtocolError, match="version"):
        unwrap_reply(reply)
    with pytest.raises(ProtocolError, match="needs a session"):
        call(handler, "contains", None, keys=[str(key(1))])
    with pytest.raises(ProtocolError, match="missing"):
        message = {"v": PROTOCOL_VERSION, "op": "get", "sid": sid, "model": MODEL}
        unwrap_reply(asyncio.run(handler.handle(message)))


def test_index_operations(handler: StorageHandler) -> None:
    sid = hello(handler)
    for i in range(3):
        put_inline(handler, sid, i, tensor(i, tokens=4, hidden=32))
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


def test_same_host_memory_hits_are_locations_in_the_shared_pool(
    tmp_path: Path, clock: FakeClock
) -> None:
    from persisting.shm import SharedPoolReader

    with KVStore(
        tmp_path / "pooled", MODEL, memory_bytes=8 << 20, disk_bytes=64 << 20, shared_memory=True
    ) as store:
        handler = StorageHandler({MODEL: store}, clock=clock)
        arena = ClientArena(4 << 20)
        try:
            client = {
                "pid": 1,
                "arena": {"path": str(arena.path), "size": arena.size, "nonce": arena.nonce},
            }
            info = call(handler, "hello", client=client)
            pool = store.shared_pool
            assert pool is not None
            assert info["pool"] == {"path": str(pool.path), "size": pool.size}
            sid = info["sid"]
            value = tensor(9, tokens=64, hidden=256)
            put_inline(handler, sid, 9, value)
            entries = call(
                handler, "get", sid, keys=[str(key(9)), str(key(10))], direct=True, pool=True
            )
            assert entries[1] is None
            offset, generation = entries[0]["pool"]
            layout = Layout.from_dict(entries[0]["layout"])
            reader = SharedPoolReader(info["pool"]["path"], info["pool"]["size"])
            out = np.empty(layout.nbytes, np.uint8)
            assert reader.read_into(offset, layout.nbytes, generation, out)
            assert torch.equal(decode_value(layout, out), value)
            # A put asked for locations tells where each stored value lies (a same-host
            # client's first get then asks nothing); a session without an arena is not told.
            told = tensor(11, tokens=64, hidden=256)
            layout, view = encode_value(told, "KV_2LTD")
            item = {
                "key": str(key(11)),
                "layout": layout.to_dict(),
                "parent": None,
                "checksum": checksum(view),
                "source": {"inline": bytes(view)},
            }
            reply = call(handler, "put", sid, items=[item], fmt="KV_2LTD", pool=True)[0]
            offset, generation = reply["pool"]
            out = np.empty(layout.nbytes, np.uint8)
            assert reader.read_into(offset, layout.nbytes, generation, out)
            assert torch.equal(decode_value(layout, out), told)
            no_arena = hello(handler)
            item["key"] = str(key(12))
            reply = call(handler, "put", no_arena, items=[item], fmt="KV_2LTD", pool=True)[0]
            assert reply["stored"] and "pool" not in reply
            reader.close()
            # Hits a client served itself are reported with touch, alone or riding along;
            # a malformed report riding along does not fail the request that carries it.
            assert call(handler, "touch", sid, keys=[str(key(9)), str(key(10))]) == 1
            assert call(handler, "contains", sid, keys=[str(key(9))], touch=[str(key(9))])
            assert call(handler, "contains", sid, keys=[str(key(9))], touch=["garbage"]) == [True]
            assert handler.counters["get_hits_remembered"] == 2
            with pytest.raises(InvalidKeyError):
                call(handler, "touch", sid, keys=["garbage"])
        finally:
            arena.close()
            handler.close()


def _arena_item(arena: ClientArena, i: int, value: torch.Tensor) -> tuple[dict, Any]:
    layout, view = encode_value(value, "KV_2LTD")
    region = arena.allocate(layout.nbytes)
    assert region is not None
    arena.region_view(region)[:] = view
    item = {
        "key": str(key(i)),
        "layout": layout.to_dict(),
        "parent": None,
        "checksum": checksum(view),
        "source": {"arena": region.offset},
    }
    return item, region


def test_arena_puts_need_a_ticket_and_a_withdrawn_ticket_never_reads_the_arena(
    handler: StorageHandler, store: KVStore
) -> None:
    arena = ClientArena(4 << 20)
    try:
        sid = hello(handler, arena)
        item, _region = _arena_item(arena, 20, tensor(20, tokens=16, hidden=64))
        with pytest.raises(ProtocolError, match="needs a ticket"):
            call(handler, "put", sid, items=[item], fmt="KV_2LTD")
        # The client gave up on request 7 before it arrived: when it arrives, it is refused
        # without touching the arena (the client may already have reused those pages).
        assert call(handler, "withdraw", sid, tickets=[7, 8]) == [7, 8]
        with pytest.raises(ProtocolError, match="withdrawn"):
            call(handler, "put", sid, items=[item], fmt="KV_2LTD", ticket=7)
        assert not store.contains(key(20))
        assert call(handler, "put", sid, items=[item], fmt="KV_2LTD", ticket=9)[0]["stored"]
        assert call(handler, "withdraw", sid, tickets=[9]) == [9]  # done: nothing left to wait for
    finally:
        arena.close()


def test_a_ticket_still_running_is_not_settled_until_it_ends() -> None:
    table = SessionTable(ttl_s=10.0)
    session = table.open({})
    table.begin_ticket(session, 1)
    assert table.withdraw(session, [1, 2]) == [2]  # 1 may still touch the arena
    with pytest.raises(ProtocolError, match="withdrawn"):
        table.begin_ticket(session, 2)  # arrived after it was withdrawn
    table.end_ticket(session, 1)
    assert table.withdraw(session, [1]) == [1]
    with pytest.raises(ProtocolError):
        table.withdraw(session, ["x"])


def test_arena_bytes_that_differ_from_the_clients_checksum_are_refused(
    handler: StorageHandler, store: KVStore
) -> None:
    arena = ClientArena(4 << 20)
    try:
        sid = hello(handler, arena)
        item, region = _arena_item(arena, 21, tensor(21, tokens=16, hidden=64))
        other = encode_value(tensor(22, tokens=16, hidden=64), "KV_2LTD")[1]
        arena.region_view(region)[:] = other  # reused before the server read it
        with pytest.raises(CorruptValueError, match="checksum"):
            call(handler, "put", sid, items=[item], fmt="KV_2LTD", ticket=1)
        assert not store.contains(key(21))
        with pytest.raises(ProtocolError, match="checksum"):
            call(handler, "put", sid, items=[dict(item, checksum=None)], fmt="KV_2LTD", ticket=2)
    finally:
        arena.close()


def test_arena_window_slots_follow_the_hosts_page_size(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a 16 KiB-page host (ARM servers): values copied into a client's window start
    # on page boundaries of *this host's* page size, the one the client rounds with too.
    import persisting.shm.pages as pages

    monkeypatch.setattr(pages, "PAGE", 16384)
    value = np.arange(2500, dtype=np.float16).reshape(2, 1, 1250, 1)  # 5000 bytes
    with open_kv_store(
        tmp_path / "wb", MODEL, memory_bytes=8 << 20, disk_bytes=64 << 20, durability="write_back"
    ) as store:
        handler = StorageHandler({MODEL: store}, clock=clock)
        arena = ClientArena(4 << 20)
        try:
            sid = hello(handler, arena)
            for i in (30, 31):
                layout, view = encode_value(value, "KV_2LTD")
                item = {
                    "key": str(key(i, dtype="half")),
                    "layout": layout.to_dict(),
                    "checksum": checksum(view),
                    "source": {"inline": bytes(view)},
                }
                call(handler, "put", sid, items=[item], fmt="KV_2LTD")
            window = arena.allocate(4 * 16384)
            assert window is not None
            entries = call(
                handler,
                "get",
                sid,
                keys=[str(key(30, dtype="half")), str(key(31, dtype="half"))],
                direct=True,
                arena=[window.offset, window.capacity],
                ticket=1,
            )
            assert [e["arena"] - window.offset for e in entries] == [0, 16384]
        finally:
            handler.close()
            arena.close()


def test_token_lookups_are_hashed_by_the_server_and_count_hit_tokens(
    handler: StorageHandler, store: KVStore
) -> None:
    from persisting.kv import TokenHasher

    sid = hello(handler)
    hasher = TokenHasher(MODEL, chunk_size=16)
    tokens = list(range(100))
    keys = [k for _s, _e, k in hasher.process_tokens(tokens)]  # 6 full chunks
    for i, chunk_key in enumerate(keys[:3]):
        value = tensor(i, tokens=16, hidden=32)
        layout, view = encode_value(value, "KV_2LTD")
        item = {
            "key": str(chunk_key),
            "layout": layout.to_dict(),
            "checksum": checksum(view),
            "source": {"inline": bytes(view)},
        }
        call(handler, "put", sid, items=[item], fmt="KV_2LTD")
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
