"""The client's transport and arena loans against a real handler over a real local channel
(in-process: no Pulsing), so failures can be made to happen at exact moments."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from persisting.kv import KVStore, open_kv_store
from persisting.kv.layout import checksum, encode_value
from persisting.service.client.member import Member, MemberFailed
from persisting.service.client.regions import ArenaLoans
from persisting.service.client.transport import Transport
from persisting.service.handler import StorageHandler
from persisting.service.local_channel import LocalChannel, LocalChannelServer
from persisting.service.protocol import make_request, unwrap_reply
from persisting.service.same_host import ClientArena
from tests.service.service_helpers import MODEL, key, tensor


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    with open_kv_store(tmp_path / "root", MODEL, memory_bytes=0, disk_bytes=64 << 20) as s:
        yield s


class Setup:
    """A handler, its local channel, and a client-side member and transport for it."""

    def __init__(self, store: KVStore):
        self.handler = StorageHandler({MODEL: store}, lease_ttl_s=30.0)
        self.arena = ClientArena(8 << 20)
        self.server = self._serve()
        client = {
            "pid": 1,
            "arena": {
                "path": str(self.arena.path),
                "size": self.arena.size,
                "nonce": self.arena.nonce,
            },
        }
        info = unwrap_reply(self.handler.answer(make_request("hello", model=MODEL, client=client)))
        assert info["shm"]
        self.member = Member(
            addr="local",
            node_id=1,
            refs=[],
            semaphore=asyncio.Semaphore(16),
            sid=info["sid"],
            info=info,
            same_host=True,
        )
        self.counters: Counter[str] = Counter()
        self.transport = Transport(
            MODEL,
            10.0,
            self.counters,
            rehello=self._never,
            answered=lambda _m: None,
            restore=self._restore,
        )

    def _serve(self) -> LocalChannelServer:
        server = LocalChannelServer(
            self.handler.answer, self.handler.is_light, self.handler.executor
        )
        server.start()
        return server

    async def _never(self, _member: Member) -> None:
        raise AssertionError("the session was not lost")

    async def _restore(self, member: Member) -> None:
        member.needs_restore = False

    async def connect(self) -> None:
        assert self.server.path is not None
        self.member.channel = await LocalChannel.open(self.server.path)

    def leases(self) -> int:
        return int(self.handler.sessions.lease_count)

    def close(self) -> None:
        self.server.close()
        self.handler.close()
        self.arena.close()


@pytest.fixture
def setup(store: KVStore) -> Iterator[Setup]:
    s = Setup(store)
    yield s
    s.close()


def _put_inline(setup: Setup, i: int) -> dict[str, Any]:
    layout, view = encode_value(tensor(i), "KV_2LTD")
    return {
        "key": str(key(i)),
        "layout": layout.to_dict(),
        "checksum": checksum(view),
        "source": {"inline": bytes(view)},
    }


def test_releases_riding_on_a_request_that_fails_are_not_lost(setup: Setup) -> None:
    async def scenario() -> tuple[int, int, list[str], int]:
        await setup.connect()
        call = setup.transport.call
        await call(setup.member, "put", items=[_put_inline(setup, 1)], fmt="KV_2LTD")
        entry = (await call(setup.member, "get", keys=[str(key(1))], direct=True))[0]
        assert "file" in entry  # read lease held until the client gives it back
        setup.member.pending_release.append(str(key(1)))
        held = setup.leases()
        setup.server.close()  # the channel breaks under the client
        await asyncio.sleep(0.05)
        with pytest.raises(MemberFailed):
            await call(setup.member, "contains", keys=[str(key(1))])
        kept = list(setup.member.pending_release)
        assert setup.member.channel is None and setup.member.needs_restore
        setup.server = setup._serve()  # the member answers again
        await setup.connect()
        await call(setup.member, "contains", keys=[str(key(1))])
        return held, setup.leases(), kept, len(setup.member.pending_release)

    held, after, kept, pending = asyncio.run(scenario())
    assert held == 1
    assert kept == [str(key(1))]  # the failed request did not take the release with it
    assert after == 0 and pending == 0  # delivered by the next request


def test_arena_regions_of_a_cancelled_request_stay_out_of_use_until_withdrawn(
    setup: Setup,
) -> None:
    async def scenario() -> tuple[int, int, int, int]:
        await setup.connect()
        member, arena = setup.member, setup.arena
        loans = ArenaLoans(arena, setup.counters, setup.transport.call)
        free_before = arena.free_bytes
        region = arena.allocate(1 << 20)
        assert region is not None
        for _ in range(16):  # every request slot taken: the put waits, then is cancelled
            await member.semaphore.acquire()
        item = dict(_put_inline(setup, 2), source={"arena": region.offset})
        task = asyncio.create_task(loans.lend(member, [region], "put", items=[item], fmt="KV_2LTD"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        quarantined = arena.free_bytes  # the region did not go back
        lent = len(member.loans)
        for _ in range(16):
            member.semaphore.release()
        while await loans.settle(member):
            await asyncio.sleep(0.01)
        await loans.close()
        return free_before, quarantined, lent, arena.free_bytes

    free_before, quarantined, lent, after = asyncio.run(scenario())
    assert lent == 1 and quarantined == free_before - (1 << 20)
    assert after == free_before  # withdrawn: the server will never read those pages
    assert setup.counters["arena_quarantined_bytes"] == 0
    assert setup.counters["arena_withdrawn_bytes"] == 1 << 20
