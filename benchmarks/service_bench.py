"""Get throughput through the KV-cache service against the same gets on an in-process store.

One client gets 8 MiB chunks (default) from a ``KVCacheStorageActor`` running in another
process on this host, for memory-tier hits and for disk hits, over the same-host path
(memory hits copied by the client out of the server's shared pool, disk hits read by the
client from the payload file under a read lease) and as a client on another host would
(``same_host=False``: data connections, see ``benchmarks/remote_bench.py`` for that path
against a plain socket). The baseline is the same gets on a
``KVStore`` opened in this process with the same settings, measured in the same run.
Every value read is checked bit-exact against what was stored, in the first round.

The first rows, **first get**, are the case a new prompt meets: each key read once. Per
round, 16 fresh chunks of [2, 16, 256, 512] bf16 are stored in the server's memory tier
(through the client) and in the in-process store's; each side then gets one other key
(warm-up) and, timed, each of the 16 keys once, each value dropped before the next get (as
an engine that moves each chunk to the GPU and lets it go; both sides then reuse warm
pages). Two service sides are timed: the client that stored the keys, and a second client
on the host that did not (its warm-up get asks the server, and the reply tells it where
recent puts placed their values). Before each timed phase the disk is let settle
(``os.sync()`` and a pause: this machine's disk keeps flushing after fsync returns and
slows whatever runs next), and the three sides take turns going first.
Each ratio is the median over rounds of in-process time / service time.

    .venv/bin/python benchmarks/service_bench.py [--chunks 16] [--rounds 9] [--batch 8]
        [--first-rounds 6] [--settle-s 2] [--first-only]

Prints one line per case with MB/s and the ratio to the in-process store; the goal for the
same-host path is >= 0.7x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from actors.launch import free_loopback_port  # noqa: E402
from persisting.kv import ChunkKey, KVStore, open_kv_store  # noqa: E402
from persisting.service import KVCacheClient  # noqa: E402

MODEL = "bench/llama-8mib"
MiB = 1 << 20


def _values(count: int, chunk_mib: int) -> list[torch.Tensor]:
    hidden = chunk_mib * MiB // (2 * 32 * 256 * 2)  # [2, 32 layers, 256 tokens, hidden] bf16
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(2, 32, 256, hidden, generator=generator).to(torch.bfloat16)
        for _ in range(count)
    ]


def _server(root: Path, name: str, addr: str, memory_bytes: int, seeds: str | None) -> Any:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(REPO),
        PERSISTING_STORAGE_PATH=str(root),
        PERSISTING_MODELS=MODEL,
        PERSISTING_KV__MEMORY_BYTES=str(memory_bytes),
        PERSISTING_KV__DISK_BYTES=str(8 << 30),
        PERSISTING_SERVICE__NAME=name,
        PERSISTING_SERVICE__ADDR=addr,
        PERSISTING_SERVICE__SEEDS=json.dumps([seeds] if seeds else []),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "actors.launch"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_ready(proc: Any) -> None:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "persisting: serving" in line:
            return
        if len(seen) > 200:
            break
    proc.kill()  # so reading the rest of its output cannot block
    raise RuntimeError(f"server did not start: {''.join(seen)}{proc.stdout.read()}")


def _settle(seconds: float) -> None:
    """Let the disk finish flushing before a timed phase (see the module docstring)."""
    os.sync()
    time.sleep(seconds)


async def _first_gets(
    store: KVStore, client: KVCacheClient, other: KVCacheClient, rounds: int, settle_s: float
) -> dict[str, tuple[float, float]]:
    """The first-get rows: per service side, (MB/s, median time ratio in-process/service);
    ``local`` has the in-process MB/s. ``own``: the client that stored the keys (the put's
    reply told it where they lie); ``other``: a second client on the host that did not."""
    shape = (2, 16, 256, 512)
    nbytes = 2 * 16 * 256 * 512 * 2
    generator = torch.Generator().manual_seed(11)
    sides = ("local", "own", "other")
    times: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(rounds):
        keys = [ChunkKey(MODEL, 1, 0, 1_000_000 + r * 100 + i, "bfloat16") for i in range(17)]
        values = [torch.randn(*shape, generator=generator).to(torch.bfloat16) for _ in keys]
        await client.batched_put(keys, values)
        store.batched_put(keys, values)
        warm, timed = keys[16], keys[:16]
        order = sides[r % 3 :] + sides[: r % 3]  # each side goes first in turn
        for side in order:
            _settle(settle_s)
            missing = 0
            if side == "local":
                store.get(warm)
                start = time.perf_counter()
                for k in timed:
                    missing += store.get(k) is None
            else:
                reader = client if side == "own" else other
                await reader.get(warm)
                start = time.perf_counter()
                for k in timed:
                    missing += await reader.get(k) is None
            times[side].append(time.perf_counter() - start)
            if missing:
                raise SystemExit(f"first get ({side}): {missing} key(s) missing")
        await client.batched_remove(keys)  # the next round starts from fresh keys
        store.batched_remove(keys)
    total = 16 * nbytes
    out: dict[str, tuple[float, float]] = {}
    for side in sides:
        ratio = statistics.median([a / b for a, b in zip(times["local"], times[side], strict=True)])
        out[side] = (total / statistics.median(times[side]) / 1e6, ratio)
    return out


async def _paired(
    units: list[tuple[Callable[[], Awaitable[int]], Callable[[], Awaitable[int]]]],
    rounds: int,
) -> tuple[float, float, float]:
    """MB/s of the baseline and the candidate, and the median per-unit time ratio.

    A unit is one get (or one batch) done both ways, back to back, so load from other
    processes on the machine falls on both alike; the ratio is the median over all units
    of baseline time / candidate time (> 1: the candidate is faster).
    """
    for baseline, candidate in units:  # warm-up
        await baseline()
        await candidate()
    base_time = cand_time = 0.0
    nbytes = 0
    ratios: list[float] = []
    for _ in range(rounds):
        for baseline, candidate in units:
            start = time.perf_counter()
            nbytes += await baseline()
            middle = time.perf_counter()
            await candidate()
            end = time.perf_counter()
            base_time += middle - start
            cand_time += end - middle
            ratios.append((middle - start) / (end - middle))
    return nbytes / base_time / 1e6, nbytes / cand_time / 1e6, statistics.median(ratios)


async def _check_exact(
    tier: str,
    store: KVStore,
    client: KVCacheClient,
    remote: KVCacheClient,
    keys: list[ChunkKey],
    values: list[torch.Tensor],
) -> None:
    """Every path returns exactly what was stored (checked once, outside the timing)."""
    for label, got in (
        ("in-process", [store.get(k) for k in keys]),
        ("same-host", await client.batched_get(keys)),
        ("remote", [await remote.get(k) for k in keys[:2]]),
    ):
        if not all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=False)):
            raise SystemExit(f"{tier}/{label}: values differ from what was stored")


async def _bench(args: argparse.Namespace) -> None:
    values = _values(args.chunks, args.chunk_mib)
    nbytes = values[0].numel() * values[0].element_size()
    keys = [ChunkKey(MODEL, 1, 0, i + 1, "bfloat16") for i in range(args.chunks)]
    fits = (args.chunks + 4) * nbytes
    with tempfile.TemporaryDirectory(prefix="persisting-service-bench-") as tmp:
        root = Path(tmp)
        mem_addr = f"127.0.0.1:{free_loopback_port()}"
        disk_addr = f"127.0.0.1:{free_loopback_port()}"
        fits += 17 * (8 << 20)  # and one first-get round of 17 chunks at a time
        servers = [_server(root / "srv-mem", "bench-mem", mem_addr, fits, None)]
        _wait_ready(servers[0])
        servers.append(_server(root / "srv-disk", "bench-disk", disk_addr, 0, mem_addr))
        _wait_ready(servers[1])
        local: dict[str, KVStore] = {
            "memory": open_kv_store(
                root / "local-mem", MODEL, memory_bytes=fits, disk_bytes=8 << 30
            ),
            "disk": open_kv_store(root / "local-disk", MODEL, memory_bytes=0, disk_bytes=8 << 30),
        }
        clients: dict[str, KVCacheClient] = {}
        try:
            for tier, name in (("memory", "bench-mem"), ("disk", "bench-disk")):
                clients[tier] = await KVCacheClient.connect(  # the first starts Pulsing
                    seeds=None if clients else [mem_addr], name=name, model=MODEL
                )
                clients[tier + "/remote"] = await KVCacheClient.connect(
                    name=name, model=MODEL, same_host=False
                )
                await clients[tier].batched_put(keys, values)
                local[tier].batched_put(keys, values)
            print(
                f"{args.chunks} chunks of {nbytes / MiB:.0f} MiB, {args.rounds} rounds; "
                f"same-host path active: {clients['memory'].same_host(mem_addr)}"
            )
            if args.first_rounds:
                other = await KVCacheClient.connect(name="bench-mem", model=MODEL)
                clients["memory/other"] = other
                first = await _first_gets(
                    local["memory"], clients["memory"], other, args.first_rounds, args.settle_s
                )
                base = first["local"][0]
                for side, what in (("own", "stored by it"), ("other", "stored by another")):
                    cand, ratio = first[side]
                    print(
                        f"memory first get, 16 keys once, {what:17s} in-process "
                        f"{base:7.0f} MB/s   service {cand:7.0f} MB/s   ratio {ratio:5.2f}x "
                        f"(median of {args.first_rounds} rotating rounds)"
                    )
            if args.first_only:
                return
            runs = [keys[i : i + args.batch] for i in range(0, len(keys), args.batch)]
            for tier in ("memory", "disk"):
                store, client, remote = local[tier], clients[tier], clients[tier + "/remote"]
                await _check_exact(tier, store, client, remote, keys, values)

                def one(fn: Callable[..., Any], arg: Any) -> Callable[[], Awaitable[int]]:
                    async def unit() -> int:
                        got = fn(arg)
                        if asyncio.iscoroutine(got):
                            got = await got
                        return sum(v.numel() * 2 for v in (got if isinstance(got, list) else [got]))

                    return unit

                cases = (
                    ("get", [(one(store.get, k), one(client.get, k)) for k in keys], args.rounds),
                    (
                        f"batched_get({args.batch})",
                        [(one(store.batched_get, r), one(client.batched_get, r)) for r in runs],
                        args.rounds,
                    ),
                    (
                        "get, remote client (data path)",
                        [(one(store.get, k), one(remote.get, k)) for k in keys[:4]],
                        1,
                    ),
                )
                for label, units, rounds in cases:
                    base, cand, ratio = await _paired(units, rounds)
                    print(
                        f"{tier:6s} {label:22s} in-process {base:7.0f} MB/s   "
                        f"service {cand:7.0f} MB/s   ratio {cand / base:5.2f}x "
                        f"(median per op {ratio:4.2f}x)"
                    )
        finally:
            for client in clients.values():
                await client.close()
            for store in local.values():
                store.close()
            for proc in servers:
                proc.terminate()
            for proc in servers:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--first-rounds", type=int, default=6, help="first-get rounds (0: skip; a multiple of 3)"
    )
    parser.add_argument("--first-only", action="store_true", help="only the first-get rows")
    parser.add_argument("--settle-s", type=float, default=2.0, help="pause before timed phases")
    args = parser.parse_args()
    asyncio.run(_bench(args))
    sys.stdout.flush()
    os._exit(0)  # Pulsing 0.1.2 may crash at interpreter exit after a shutdown


if __name__ == "__main__":
    main()
