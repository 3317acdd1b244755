"""A fleet on hosts of its own: three ``persisting serve`` members (no ``--model``, two copies,
TLS between hosts) and two engine hosts, each a network and UTS namespace on one switch
(:class:`tests.netns.Hosts`). Each engine reaches the members by its ``cluster`` key.

- vLLM's own tiered offloading (``TieringOffloadingManager``) with ``PersistingTier``:
  chunks stored from one engine host are promoted bit-exact by a new process on the other;
  shortly after that one reuse the members hold two copies of them; a member holding copies
  is SIGKILLed and a new process still promotes every chunk, with no wrong byte.
- SGLang's HiCache through its ``StorageBackendFactory`` and host pool: pages set on one
  engine host are read bit-exact on the other, and again after a member holding copies
  is SIGKILLed.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from persisting.integrations.vllm.settings import tiering_config
from tests.engines.engine_helpers import Tiering
from tests.netns import Hosts, netns_available
from tests.service.service_helpers import REPO, kill_group, server_env, spawn, wait_for_log
from tests.sglang.sglang_helpers import page_keys, run_kit
from tests.timing import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = 8610
MEMBERS = 3
ENGINES = (3, 4)  # the engine hosts
ROW_KIB = 64  # per rank: a row of two ranks is 128 KiB
CHUNKS = 64


@dataclass
class Fleet:
    hosts: Hosts
    work: Path
    passphrase: str
    passphrase_file: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def seeds(self) -> list[str]:
        return [f"{ip}:{PORT}" for ip in self.hosts.ips[:MEMBERS]]

    def cluster(self) -> dict[str, Any]:
        return {"seeds": self.seeds, "passphrase_file": str(self.passphrase_file)}

    def start_member(self, i: int) -> None:
        root = self.work / f"member{i}"
        env = server_env(root, PERSISTING_SERVICE__MEMBER_RETRY_S="0.5")
        env.pop("PERSISTING_MODELS")  # a fleet's member serves whatever namespace is opened
        args = [sys.executable, "-m", "persisting.cli", "serve", "--storage-path", str(root),
                "--addr", self.seeds[i], "--passphrase", self.passphrase]  # fmt: skip
        if i:
            args += ["--seed", self.seeds[0]]
        log = self.work / f"member{i}.log"
        self.procs.append(spawn(self.hosts.on(i, args), env, log))
        wait_for_log(log, "data path", self.procs[-1])

    def survey(self, host: int) -> dict[str, Any]:
        """``persisting stats --service`` of every member, asked from ``host``."""
        env = {k: v for k, v in server_env(self.work).items() if not k.startswith("PERSISTING_")}
        env["PERSISTING_SERVICE__PASSPHRASE"] = self.passphrase
        args = [str(Path(sys.executable).with_name("persisting")), "stats", "--json"]
        for seed in self.seeds:
            args += ["--service", seed]
        out = subprocess.run(self.hosts.on(host, args), capture_output=True, text=True,
                             timeout=120, env=env, cwd=REPO)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    why = netns_available()
    if why is not None:
        pytest.fail(why)  # CI runs as root with iproute2 (scripts/install.sh)
    secret = secrets.token_hex(16)
    passphrase_file = tmp_path / "passphrase"
    passphrase_file.write_text(secret)
    passphrase_file.chmod(0o600)
    with Hosts(MEMBERS + len(ENGINES), "fl") as hosts:
        fleet = Fleet(hosts, tmp_path, secret, passphrase_file)
        try:
            for i in range(MEMBERS):
                fleet.start_member(i)
            yield fleet
        finally:
            for proc in fleet.procs:
                kill_group(proc)


def _tier(fleet: Fleet) -> dict[str, Any]:
    extra = {"model_version": "fleet-weights", "refresh_interval_s": 0.2,
             "cluster": fleet.cluster()}  # fmt: skip
    (entry,) = tiering_config(extra)["secondary_tiers"]
    return dict(entry)


def _plan(fleet: Fleet, steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"row_kib": ROW_KIB, "world_size": 2, "chunks": CHUNKS, "events": False,
            "tiers": [_tier(fleet)], "steps": steps}  # fmt: skip


def _held(survey: dict[str, Any]) -> tuple[int, int]:
    """Items and bytes the members' stores hold on disk, all together."""
    items = nbytes = 0
    for member in survey["members"]:
        for store in (member.get("stores") or {}).values():
            items += int(store.get("disk_items", 0))
            nbytes += int(store.get("disk_bytes", 0))
    return items, nbytes


def _copies_of_the_reused(fleet: Fleet, host: int, items: int) -> tuple[str, tuple[int, int]]:
    """Wait until the members hold ``items`` values: a member holding some, and the items
    and bytes they all hold."""
    surveys: list[dict[str, Any]] = []

    def copied() -> bool:
        surveys.append(fleet.survey(host))
        return _held(surveys[-1])[0] >= items

    wait_until(copied, f"{items} values on the members", 120)
    members = surveys[-1]["members"]
    holder = str(next(m["addr"] for m in members if _held({"members": [m]})[0]))
    return holder, _held(surveys[-1])


def test_vllm_tier_chunks_reused_across_hosts_and_kept_through_a_lost_member(
    fleet: Fleet,
) -> None:
    a, b = ENGINES
    store = Tiering(_plan(fleet, [{"action": "store", "seed": 1, "count": CHUNKS, "jobs": 8}]),
                    fleet.work, "store", on_host=fleet.hosts.on(a, [])).result()  # fmt: skip
    row = 2 * ROW_KIB << 10
    assert sum(s["bytes"] for s in store["steps"] if s["action"] == "store") == CHUNKS * row

    promote = [{"action": "promote", "seed": 1, "count": CHUNKS, "jobs": 4}]
    reuse = Tiering(_plan(fleet, promote), fleet.work, "reuse",
                    on_host=fleet.hosts.on(b, [])).result()  # fmt: skip
    (first,) = [s for s in reuse["steps"] if s["action"] == "promote"]
    assert first["hits"] == list(range(CHUNKS)) and first["identical"]

    # Shortly after that one reuse, every chunk is on two members.
    holder, (items, nbytes) = _copies_of_the_reused(fleet, b, 2 * CHUNKS)
    assert nbytes >= 1.8 * CHUNKS * row, (items, nbytes)
    kill_group(fleet.procs[fleet.seeds.index(holder)])
    after = Tiering(_plan(fleet, promote), fleet.work, "after-loss",
                    on_host=fleet.hosts.on(a, [])).result()  # fmt: skip
    (lost,) = [s for s in after["steps"] if s["action"] == "promote"]
    assert len(lost["hits"]) >= 61 and lost["identical"], lost


def _sglang(fleet: Fleet, steps: list[dict[str, Any]]) -> dict[str, Any]:
    extra = {"backend_name": "persisting", "module_path": "persisting.integrations.sglang",
             "class_name": "PersistingHiCacheStorage", "interface_v1": 1,
             "model_version": "fleet-weights", "cluster": fleet.cluster()}  # fmt: skip
    pool = {"kind": "mha", "layout": "page_first"}
    return {"pool": pool, "backend": {"name": "dynamic", "extra": extra}, "steps": steps}


def test_sglang_pages_reused_across_hosts_and_kept_through_a_lost_member(fleet: Fleet) -> None:
    a, b = ENGINES
    keys, slots = page_keys(16, seed=7), list(range(16))
    wrote = run_kit(_sglang(fleet, [
        {"do": "fill", "slots": slots, "seed": 3},
        {"do": "digest", "slots": slots},
        {"do": "set", "keys": keys, "slots": slots},
    ]), fleet.work, "sglang-set", on_host=fleet.hosts.on(a, []))["steps"]  # fmt: skip
    digests, stored = wrote[1], wrote[2]
    assert stored == [True] * 16 and len(set(digests)) == 16
    other = [20 + s for s in slots]
    read = [
        {"do": "exists", "keys": keys},
        {"do": "get", "keys": keys, "slots": other},
        {"do": "digest", "slots": other},
    ]
    got = run_kit(_sglang(fleet, read), fleet.work, "sglang-get",
                  on_host=fleet.hosts.on(b, []))["steps"]  # fmt: skip
    assert got[0] == 16 and got[1] == [True] * 16 and got[2] == digests

    holder, _held_now = _copies_of_the_reused(fleet, b, 2 * 16)
    kill_group(fleet.procs[fleet.seeds.index(holder)])
    again = run_kit(_sglang(fleet, read), fleet.work, "sglang-after-loss",
                    on_host=fleet.hosts.on(a, []))["steps"]  # fmt: skip
    assert again[0] == 16 and again[1] == [True] * 16 and again[2] == digests
