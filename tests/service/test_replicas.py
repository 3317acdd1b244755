"""Two copies of what is read, on three ``persisting serve`` processes started without
models: a put is stored on its owner; a read makes the second copy in the background; the
survivors of a SIGKILLed member copy between them what lost its second copy, and no key
misses; a member that comes back empty receives the keys it should hold; one that restarts
on its disk knows again which of its keys are wanted."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest

from persisting.service.routing import rank_members
from tests.service.service_helpers import (
    free_port,
    key,
    kill_group,
    processes,
    run_client,
    start_serve,
    wait_for_log,
)
from tests.timing import wait_until

pytestmark = pytest.mark.timeout(300)

N = 24
MEMBER = {
    "PERSISTING_MODELS": "",  # serve whatever namespace a client opens
    "PERSISTING_KV__DURABILITY": "sync",
    "PERSISTING_KV__MEMORY_BYTES": str(8 << 20),
}


def _held(seeds: list[str], until: int, min_members: int, **more: Any) -> dict[str, Any]:
    return run_client(
        "held_copies",
        {"seeds": seeds, "until": until, "min_members": min_members, "wait_s": 90, **more},
    )


def test_a_read_key_gets_a_second_copy_and_survives_a_member_killed(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    seeds = [addrs[0]]

    metrics_port = free_port()

    def member(i: int, root: str, seed_from: int = 0) -> Any:
        log = tmp_path / f"{root}-{len(procs)}.log"
        seed = {"PERSISTING_SERVICE__SEEDS": f'["{addrs[seed_from]}"]'} if i != seed_from else {}
        if i == 0:  # one member's metrics: its copies, as an operator watches them
            seed["PERSISTING_SERVICE__METRICS_PORT"] = str(metrics_port)
        proc = start_serve(tmp_path / root, ports[i], log, **MEMBER, **seed)
        wait_for_log(log, "data path", proc)
        return proc

    with processes() as procs:
        procs.extend(member(i, f"root{i}") for i in range(3))
        put = run_client("put_keys", {"seeds": seeds, "start": 0, "stop": N, "min_members": 3})
        assert put["stored"] == N
        once = _held(seeds, N, 3)
        assert sum(m["keys"] for m in once.values()) == N  # a put is one copy
        got = run_client("get_keys", {"seeds": seeds, "start": 0, "stop": N, "min_members": 3})
        assert got["hit"] == N and got["wrong"] == 0
        twice = _held(seeds, 2 * N, 3)  # the first read made each key's second copy
        assert sum(m["keys"] for m in twice.values()) == 2 * N, twice
        for addr, held in twice.items():
            mine = sum(addr in rank_members(str(key(i)), addrs)[:2] for i in range(N))
            assert held["keys"] == mine, (addr, twice)

        victim = 1
        kill_group(procs[victim])
        survivors = [a for i, a in enumerate(addrs) if i != victim]
        # with nothing read meanwhile, both survivors come to hold every key again: the
        # member that received a copy heals it as the one that sent it does
        healed = _held(seeds, 2 * N, 2)
        assert all(healed[a]["keys"] == N for a in survivors), healed
        after = run_client("get_keys", {"seeds": seeds, "start": 0, "stop": N, "min_members": 2})
        assert after["hit"] == N and after["wrong"] == 0 and not after["errors"], after

        procs.append(member(victim, "root1-new"))  # back on its address, with an empty disk
        ranked = sum(addrs[victim] in rank_members(str(key(i)), addrs)[:2] for i in range(N))
        back = _held(seeds, 2 * N + ranked, 3)
        # at least the keys it ranks for (a survivor whose view of the members lagged while
        # it came back may send it more: extra copies, which its budget bounds)
        assert back[addrs[victim]]["keys"] >= ranked, back
        final = run_client("get_keys", {"seeds": seeds, "start": 0, "stop": N, "min_members": 3})
        assert final["hit"] == N and final["wrong"] == 0
        texts: list[str] = []

        def healed() -> bool:  # what an operator waits for after a member's return
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            texts.append(urllib.request.urlopen(url, timeout=30).read().decode())
            return float(_sample(texts[-1], "persisting_service_copies_due")) == 0

        wait_until(healed, "member 0's copies_due back to 0", 60)
        sent = float(_sample(texts[-1], 'persisting_service_copies_total{outcome="sent"}'))
        assert sent > 0 and float(_sample(texts[-1], "persisting_service_copy_bytes_total")) > 0

        # member 0 restarts on its own disk, having forgotten which keys were wanted: it
        # surveys those it holds (each is wanted, another member holds it too); then member
        # 2 is lost, and 0 and 1 come to hold every key between them
        kill_group(procs[0])
        procs.append(member(0, "root0", seed_from=1))
        seeds = [addrs[1]]
        restarted = _held(seeds, 2 * N, 3, surveyed=addrs[0], wanted=N)
        assert restarted[addrs[0]]["copies"]["keys_surveyed"] == N, restarted
        kill_group(procs[2])
        last = _held(seeds, 2 * N, 2)
        assert last[addrs[0]]["keys"] == N and last[addrs[1]]["keys"] == N, last


def _sample(text: str, name: str) -> str:
    return next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " "))
