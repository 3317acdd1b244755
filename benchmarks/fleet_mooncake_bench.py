"""Persisting against Mooncake Store on one fleet topology: three member hosts and two
client hosts, each a network and UTS namespace on one switch (:class:`tests.netns.Hosts`;
root). Needs Mooncake in an environment of its own: ``bash scripts/install_mooncake.sh``
(``.venv-mooncake``; Mooncake is no dependency of Persisting or its tests).

* **Persisting**: ``persisting serve`` on each member host (no ``--model``,
  ``service.replicas`` 2, the default), twice: one cluster with ``bulk_encryption`` off
  (rows ``persisting``) and one with TLS on between hosts (``persisting-tls``, the default).
  Clients: ``SyncKVCacheClient.connect(seeds=..., name="kvstore", model=...)``,
  ``batched_put`` / ``get_into`` / ``batched_get_into``. A put counts as stored when its
  owner has acknowledged it; the second copy is made on the key's first read.
* **Mooncake** (``mooncake-transfer-engine-non-cuda`` 0.3.13.post1): ``mooncake_master`` on
  member host 0, a storage process (a Mooncake client contributing a global segment) on each
  member host, clients with no segment of their own, TCP, ``P2PHANDSHAKE`` metadata,
  ``replica_num=2`` (rows ``mooncake``): its put writes both copies before it returns. Its put
  row is also measured with ``replica_num=1`` (``mooncake-1copy``), one copy as Persisting's
  acknowledged put. ``batch_put_from`` / ``get_into`` / ``batch_get_into`` with registered
  buffers.

Per round, value size and side (the sides take turns going first), two jobs, each in a NEW
client process: a **put** job on client host 3 (``--count`` values in batches of
``--batch``), then a **read** job on client host 4: ``get_into`` one key after another, then
batched gets (``--batch`` keys a call), each into memory the process keeps (allocated and
touched before the timing). Before every timed phase ``os.sync()`` and ``--settle-s`` of
pause: the virtual disk here keeps writing long after an fsync. Every value read is checked
byte for byte after the timing. Rows print each side's median MB/s (10^6 bytes) over rounds
and the median per-round ratio Persisting / Mooncake (``replica_num=2``).

Then a member is lost, on each side in turn: a put job stores 64 values of 2 MiB, a new
process reads them once (Persisting: then waits until each has its second copy), member
host 1's process is SIGKILLed, and a new reader on the other client host counts the
values it gets right at once and again ``--later-s`` after that first read.

    sudo .venv/bin/python benchmarks/fleet_mooncake_bench.py [--rounds 3] [--count 32]
        [--sizes-mib 2 8] [--batch 8] [--settle-s 2] [--later-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.fleet_mooncake_jobs import MASTER_PORT, MiB  # noqa: E402
from tests.netns import Hosts, netns_available  # noqa: E402

JOBS = str(REPO / "benchmarks" / "fleet_mooncake_jobs.py")
MEMBERS = (0, 1, 2)
WRITER, READER = 3, 4
PORTS = {"persisting": 8710, "persisting-tls": 8720}
SIDES = ("persisting", "persisting-tls", "mooncake", "mooncake-1copy")
ROWS = ("put", "get", "batched get")
VICTIM = 1
MODEL = "bench/fleet"


@dataclass
class Fleet:
    hosts: Hosts
    work: Path
    args: argparse.Namespace
    passphrase: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=dict)

    def seeds(self, side: str) -> list[str]:
        return [f"{self.hosts.ips[i]}:{PORTS[side]}" for i in MEMBERS]

    def spawn(self, group: str, host: int, args: list[str], env: dict[str, str]) -> Path:
        log = self.work / f"{group}-{host}.log"
        handle = open(log, "wb")  # noqa: SIM115 - closed by the OS when the child exits
        proc = subprocess.Popen(self.hosts.on(host, args), env=env, cwd=REPO, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs.setdefault(group, []).append(proc)
        return log

    def start_persisting(self, side: str) -> None:
        env = clean_env()
        env.update(
            PERSISTING_KV__MEMORY_BYTES=str(self.args.member_memory_mib * MiB),
            PERSISTING_KV__DISK_BYTES=str(16 << 30),
            PERSISTING_SERVICE__BULK_ENCRYPTION="true" if side.endswith("tls") else "false",
            PERSISTING_SERVICE__REQUEST_TIMEOUT_S="120",
            PERSISTING_SERVICE__MEMBER_RETRY_S="0.5",
        )
        seeds = self.seeds(side)
        for i in MEMBERS:
            args = [sys.executable, "-m", "persisting.cli", "serve", "--storage-path",
                    str(self.work / f"{side}-{i}"), "--addr", seeds[i],
                    "--passphrase", self.passphrase]  # fmt: skip
            if i:
                args += ["--seed", seeds[0]]
            wait_for(self.spawn(side, i, args, env), "data path", self.procs[side][-1])

    def start_mooncake(self) -> None:
        master = [str(Path(self.args.mooncake_python).with_name("mooncake_master")),
                  f"--rpc_port={MASTER_PORT}", f"--rpc_address={self.hosts.ips[0]}"]  # fmt: skip
        log = self.spawn("mooncake-master", 0, master, clean_env())
        time.sleep(2)
        if self.procs["mooncake-master"][-1].poll() is not None:
            raise SystemExit(f"mooncake_master exited:\n{log.read_text(errors='replace')}")
        for i in MEMBERS:
            config = {"local_ip": self.hosts.ips[i], "master_ip": self.hosts.ips[0],
                      "segment_bytes": self.args.segment_mib * MiB}  # fmt: skip
            args = [self.args.mooncake_python, JOBS, "mooncake-storage", json.dumps(config)]
            log = self.spawn("mooncake", i, args, clean_env())
            wait_for(log, "READY", self.procs["mooncake"][-1])

    def job(self, side: str, host: int, config: dict[str, Any]) -> dict[str, Any]:
        """One client job in a new process on ``host``; its RESULT."""
        if side.startswith("mooncake"):
            config = {**config, "local_ip": self.hosts.ips[host], "master_ip": self.hosts.ips[0],
                      "prefix": f"{config['prefix']}-{side}"}  # fmt: skip
            args = [self.args.mooncake_python, JOBS, "mooncake-job", json.dumps(config)]
        else:
            config = {**config, "seeds": self.seeds(side), "passphrase": self.passphrase,
                      "model": f"{MODEL}-{side}"}  # fmt: skip
            args = [sys.executable, JOBS, "persisting-job", json.dumps(config)]
        out = subprocess.run(self.hosts.on(host, args), env=clean_env(), cwd=REPO,
                             capture_output=True, text=True, timeout=1800)  # fmt: skip
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                return dict(json.loads(line[7:]))
        raise SystemExit(f"a {side} job failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")

    def member_cpu(self, side: str) -> float:
        """CPU seconds the side's member processes have used so far (Mooncake: its master
        and storage processes, shared by both replica settings)."""
        groups = ["mooncake", "mooncake-master"] if side.startswith("mooncake") else [side]
        ticks = 0
        for proc in (p for g in groups for p in self.procs.get(g, [])):
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                kill(proc)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = log.read_text(errors="replace") if log.exists() else ""
        if text in seen:
            return
        if proc.poll() is not None:
            raise SystemExit(f"{log.name}: exited before {text!r}:\n{seen[-4000:]}")
        time.sleep(0.2)
    raise SystemExit(f"{log.name}: no {text!r} in {timeout_s}s")


def kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait(timeout=30)


# -- the timed rounds ----------------------------------------------------------------------


Times = dict[str, dict[float, dict[str, list[float]]]]


@dataclass
class Results:
    times: Times  # seconds per side, size, row and round
    cpu: Times  # the client's CPU seconds in the same phases
    member_cpu: dict[str, float]  # the members' CPU seconds over all rounds, per side
    moved: dict[str, int]  # bytes each side's rows moved over all rounds
    bad: int = 0  # values failed or wrong


def run_rounds(fleet: Fleet) -> Results:
    """Every round, size and side: a put job, then (but for mooncake-1copy) a read job."""
    args = fleet.args
    res = Results({side: {mib: {} for mib in args.sizes_mib} for side in SIDES},
                  {side: {mib: {} for mib in args.sizes_mib} for side in SIDES},
                  {side: -fleet.member_cpu(side) for side in SIDES},
                  dict.fromkeys(SIDES, 0))  # fmt: skip
    times = res.times
    for r in range(args.rounds):
        order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
        for mib in args.sizes_mib:
            for side in order:
                kib = round(mib * 1024)
                config = {"count": args.count, "nbytes": kib << 10, "batch": args.batch,
                          "settle_s": args.settle_s, "seed": r * 100_000 + kib, "min_members": 3,
                          "key_base": 1 + (r * 100_000 + kib) * 1000, "replicas": 2,
                          "prefix": f"r{r}-{kib}k"}  # fmt: skip
                jobs = ["put"] if side == "mooncake-1copy" else ["put", "read"]
                if side == "mooncake-1copy":
                    config["replicas"] = 1
                for job in jobs:
                    host = WRITER if job == "put" else READER
                    result = fleet.job(side, host, {**config, "job": job})
                    res.bad += int(result.get("failed", 0)) + int(result.get("wrong", 0))
                    for row, seconds in result["seconds"].items():
                        times[side][mib].setdefault(row, []).append(float(seconds))
                        res.cpu[side][mib].setdefault(row, []).append(result["cpu"][row])
                        res.moved[side] += int(args.count * mib * MiB)
                print(f"round {r} {mib:g} MiB {side}: " + ", ".join(
                    f"{row} {args.count * mib * MiB / s[-1] / 1e6:.0f} MB/s"
                    for row, s in times[side][mib].items()), flush=True)  # fmt: skip
    for side in SIDES:
        res.member_cpu[side] += fleet.member_cpu(side)
    return res


# -- a lost member -------------------------------------------------------------------------------


def lose_a_member(fleet: Fleet, side: str) -> dict[str, Any]:
    """Store 64 values, read them once, SIGKILL member host 1's process, then count what a
    new reader gets right at once and ``--later-s`` after."""
    args = fleet.args
    config = {"count": 64, "nbytes": 2 * MiB, "batch": args.batch, "settle_s": 0.0,
              "seed": 7, "min_members": 3, "key_base": 9_000_000, "replicas": 2,
              "prefix": "loss"}  # fmt: skip
    fleet.job(side, WRITER, {**config, "job": "put"})
    once = fleet.job(side, READER, {**config, "job": "probe", "wait_copies": 2})
    assert once["hits"] == 64, once
    kill(fleet.procs[side][VICTIM])
    killed = time.monotonic()
    after = {**config, "job": "probe", "min_members": 2}
    first = fleet.job(side, WRITER, after)
    first_s = time.monotonic() - killed
    time.sleep(args.later_s)
    later = fleet.job(side, READER, after)
    later_s = time.monotonic() - killed
    return {"at once": first["hits"], "at once s": first_s, "later": later["hits"],
            "later s": later_s, "wrong": first["wrong"] + later["wrong"]}  # fmt: skip


# -- the report ----------------------------------------------------------------------------------


def mbps(args: argparse.Namespace, mib: float, seconds: list[float]) -> float:
    return args.count * mib * MiB / statistics.median(seconds) / 1e6


def ratio(ours: list[float], theirs: list[float]) -> float:
    """Median per-round throughput ratio (their seconds over ours)."""
    return statistics.median(t / o for o, t in zip(ours, theirs, strict=True))


def report(args: argparse.Namespace, res: Results, losses: dict[str, Any]) -> None:
    times = res.times
    print(f"\n{args.rounds} rounds, {args.count} values per row, batches of {args.batch}, "
          f"settle {args.settle_s} s; failed or wrong values: {res.bad}; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")  # fmt: skip
    head = (f"{'row':<16} {'Persisting':>10} {'Mooncake':>9} {'ratio':>6}  "
            f"{'TLS on':>7} {'ratio':>6}  {'Mooncake 1 copy':>15} {'ratio':>6}")  # fmt: skip
    print(head)
    for row in ROWS:
        for mib in args.sizes_mib:
            ours, tls = times["persisting"][mib][row], times["persisting-tls"][mib][row]
            theirs = times["mooncake"][mib][row]
            line = (f"{row + f' {mib:g} MiB':<16} {mbps(args, mib, ours):>10.0f} "
                    f"{mbps(args, mib, theirs):>9.0f} {ratio(ours, theirs):>5.2f}x  "
                    f"{mbps(args, mib, tls):>7.0f} {ratio(tls, theirs):>5.2f}x")  # fmt: skip
            if row == "put":
                one = times["mooncake-1copy"][mib][row]
                line += f"  {mbps(args, mib, one):>15.0f} {ratio(ours, one):>5.2f}x"
            rounds = " ".join(f"{t / o:.2f}x" for o, t in zip(ours, theirs, strict=True))
            print(f"{line}  per round {rounds}")
    print(
        "MB/s = 10^6 bytes/s; ratio = Persisting / Mooncake (replica_num=2) per round, "
        "median; put: Persisting's counts the owner's copy, Mooncake's both copies"
    )
    report_cpu(args, res)
    for side, loss in losses.items():
        print(
            f"lost member, {side}: {loss['at once']}/64 at once ({loss['at once s']:.1f} s "
            f"after the kill), {loss['later']}/64 later ({loss['later s']:.1f} s), "
            f"wrong {loss['wrong']}"
        )


def report_cpu(args: argparse.Namespace, res: Results) -> None:
    """CPU seconds per GB moved: each client's in its timed phases (median over rounds),
    and all the members' over the whole run (write-behind and copies included)."""
    print("CPU s per GB, client (timed phases): " + " ".join(f"{side:>14}" for side in SIDES))
    for row in ROWS:
        for mib in args.sizes_mib:
            gb = args.count * mib * MiB / 1e9
            cells = [res.cpu[side][mib].get(row) for side in SIDES]
            text = [f"{statistics.median(c) / gb:>14.2f}" if c else " " * 14 for c in cells]
            print(f"  {row + f' {mib:g} MiB':<34}" + " ".join(text))
    moved = dict(res.moved)
    moved["mooncake"] += moved.pop("mooncake-1copy")  # the same member processes
    print("CPU s per GB moved, members (all rounds, all their work): " + ", ".join(
        f"{side} {res.member_cpu[side] / (n / 1e9):.2f}" for side, n in moved.items()))  # fmt: skip


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(f"terminated by signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[2, 8])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--later-s", type=float, default=10.0)
    parser.add_argument("--segment-mib", type=int, default=2048, help="Mooncake, per member")
    parser.add_argument("--member-memory-mib", type=int, default=1024, help="Persisting")
    parser.add_argument("--mooncake-python", default=str(REPO / ".venv-mooncake/bin/python"))
    parser.add_argument("--no-loss", action="store_true", help="skip the lost-member phase")
    args = parser.parse_args()
    why = netns_available()
    if why is not None:
        raise SystemExit(why)
    if not Path(args.mooncake_python).exists():
        raise SystemExit("no Mooncake environment: run scripts/install_mooncake.sh")
    signal.signal(signal.SIGTERM, _terminated)  # a killed run still stops what it started
    work = Path(tempfile.mkdtemp(prefix="persisting-fleet-mooncake-"))
    with Hosts(len(MEMBERS) + 2, "mc") as hosts:
        fleet = Fleet(hosts, work, args)
        try:
            fleet.start_mooncake()
            for side in PORTS:
                fleet.start_persisting(side)
            res = run_rounds(fleet)
            losses = {}
            if not args.no_loss:
                losses = {side: lose_a_member(fleet, side) for side in ("mooncake", "persisting")}
            report(args, res, losses)
        except BaseException:
            print(f"logs kept in {work}", file=sys.stderr)
            raise
        finally:
            fleet.stop()
    shutil.rmtree(work, ignore_errors=True)  # on success, once nothing writes there


if __name__ == "__main__":
    main()
