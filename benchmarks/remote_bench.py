"""Remote puts and gets the way a client on another host makes them, against a plain socket.

Every timed job runs in a NEW client process that keeps every value it gets (fresh
memory per value, nothing recycled), on each side:

* **persisting** -- ``persisting serve`` (``python -m actors.launch``, ``durability``
  ``async`` by default) in its own process; the client connects with
  ``KVCacheClient.connect(..., same_host=False)``, so its values move on TCP as from
  another host (TLS unless the address is loopback or ``bulk_encryption`` is off);
* **socket** -- the baseline: a server process that receives each put into a new buffer
  it keeps (acknowledged with one byte) and sends gets from chunks made at start, and a
  client that sends each value from its own memory and receives each value into a new
  ``bytearray`` it keeps, one round trip per value (per batch for the batched row), as
  the service does. Both ends keep what they receive in fresh memory, as callers do.

Per round and side (the sides taking turns going first), two jobs:

1. **write-read**: put N chunks one by one (``put``), then at once get each one by one
   (``get after put``: the server's writes behind the puts are still going);
2. **read settled**: wait until the server has written every put (``pending_puts`` of its
   stats, zero), ``os.sync()`` and a pause, then get each chunk one by one
   (``get settled``) and in batches (``batched get``).

Each job first opens its connections with one small put and get of its own key (not
timed). Every value read is compared with what was put, after the timing; a wrong value
fails the run. Rows print each side's median GB/s over rounds and the median per-round
ratio to the socket; every round's ratio is printed too.

``--network loopback`` (default) runs on 127.0.0.1: the data path is plain. ``--network
veth`` puts the servers in one network namespace and the clients in another, joined by a
veth pair (root; made and removed by the run): the data path is TLS there, and
``--plain-too`` adds a second Persisting server with ``bulk_encryption = false`` to the
same run (rows ``persisting-plain``), so encrypted and plain are measured side by side.

    .venv/bin/python benchmarks/remote_bench.py [--chunks 32] [--chunk-mib 8] [--rounds 3]
        [--batch 8] [--durability async] [--network loopback|veth] [--plain-too]
        [--settle-s 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = "bench/remote-8mib"
PASSPHRASE = "remote-bench-passphrase"
MiB = 1 << 20
_COMMAND = struct.Struct("<cII")  # op, first chunk, count
ROWS = ("put", "get after put", "get settled", "batched get")


def _values(count: int, chunk_mib: int, seed: int) -> list[Any]:
    import torch

    hidden = chunk_mib * MiB // (2 * 32 * 256 * 2)  # [2, 32 layers, 256 tokens, hidden] bf16
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, 32, 256, hidden, generator=generator).to(torch.bfloat16)
        for _ in range(count)
    ]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _settle(seconds: float) -> None:
    os.sync()
    time.sleep(seconds)


# -- the plain socket ------------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def socket_server(bind: str, nbytes: int, chunks: int) -> None:
    """The baseline's server. A put is received into a new buffer that it keeps (as a store
    keeps what it is given: ``kept``, per connection) and acknowledged; a get sends its
    chunks from buffers made at start. One client connection after another."""
    import numpy as np

    host, port = bind.rsplit(":", 1)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    listener.listen(8)
    buffers = [np.empty(nbytes, np.uint8) for _ in range(chunks)]
    for b in buffers:
        b[:] = 1
    print("READY", flush=True)
    command = bytearray(_COMMAND.size)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kept: list[bytearray] = []
        while True:
            try:
                _recv_exactly(conn, memoryview(command))
            except (ConnectionError, OSError):
                break
            op, first, count = _COMMAND.unpack(command)
            if op == b"g":
                for b in buffers[first : first + count]:
                    conn.sendall(b.data)
            else:
                for _ in range(count):
                    value = bytearray(nbytes)  # a new buffer per value, kept
                    _recv_exactly(conn, memoryview(value))
                    kept.append(value)
                conn.sendall(b"k")
        conn.close()
        del kept


def socket_job(config: dict[str, Any]) -> dict[str, Any]:
    """One job of the baseline in this (new) process; seconds per row."""
    import torch

    values = _values(config["chunks"], config["chunk_mib"], config["seed"])
    sources = [v.view(-1).view(torch.uint8).numpy() for v in values]
    nbytes = sources[0].nbytes
    host, port = config["addr"].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)
    kept: list[bytearray] = []

    def put() -> None:
        for i, source in enumerate(sources):
            sock.sendall(_COMMAND.pack(b"p", i, 1))
            sock.sendall(source.data)
            _recv_exactly(sock, memoryview(ack))

    def get(batch: int) -> None:
        for first in range(0, len(sources), batch):
            count = min(batch, len(sources) - first)
            sock.sendall(_COMMAND.pack(b"g", first, count))
            for _ in range(count):
                out = bytearray(nbytes)  # a new buffer per value, kept
                _recv_exactly(sock, memoryview(out))
                kept.append(out)

    out: dict[str, float] = {}
    if config["job"] == "write-read":
        out["put"] = _timed(put)
        out["get after put"] = _timed(lambda: get(1))
    else:
        _settle(config["settle_s"])
        out["get settled"] = _timed(lambda: get(1))
        out["batched get"] = _timed(lambda: get(config["batch"]))
    sock.close()
    return {"seconds": out, "wrong": 0}


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the service -------------------------------------------------------------------------------


async def persisting_job(config: dict[str, Any]) -> dict[str, Any]:
    """One job through the service in this (new) process; seconds per row, values wrong."""
    import torch

    from persisting.config import PersistingSettings
    from persisting.kv import ChunkKey
    from persisting.service import KVCacheClient

    values = _values(config["chunks"], config["chunk_mib"], config["seed"])
    keys = [ChunkKey(MODEL, 1, 0, config["key_base"] + i, "bfloat16") for i in range(len(values))]
    settings = PersistingSettings(models=[MODEL], service={"request_timeout_s": 120.0})
    client = await KVCacheClient.connect(
        seeds=[config["server"]],
        model=MODEL,
        passphrase=PASSPHRASE,
        settings=settings,
        same_host=False,
    )
    kept: list[Any] = []
    out: dict[str, float] = {}
    try:
        warm = ChunkKey(MODEL, 1, 0, config["key_base"] + 999_999, "bfloat16")
        await client.put(warm, torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16))
        await client.get(warm)  # connections open, not timed
        if config["job"] == "write-read":
            start = time.perf_counter()
            for k, v in zip(keys, values, strict=True):
                await client.put(k, v)
            out["put"] = time.perf_counter() - start
            start = time.perf_counter()
            for k in keys:
                kept.append(await client.get(k))
            out["get after put"] = time.perf_counter() - start
            checked = kept
        else:
            await _wait_written(client)
            _settle(config["settle_s"])
            start = time.perf_counter()
            for k in keys:
                kept.append(await client.get(k))
            out["get settled"] = time.perf_counter() - start
            checked = list(kept)
            start = time.perf_counter()
            for first in range(0, len(keys), config["batch"]):
                kept.extend(await client.batched_get(keys[first : first + config["batch"]]))
            out["batched get"] = time.perf_counter() - start
            checked += kept[len(keys) :]
            await client.batched_remove([*keys, warm])
        wrong = sum(
            g is None or not torch.equal(g, v) for g, v in zip(checked, values * 2, strict=False)
        )
        return {"seconds": out, "wrong": wrong, "counters": dict(client.counters)}
    finally:
        await client.close()


async def _wait_written(client: Any) -> None:
    """Until the servers have written every put behind (``pending_puts`` zero)."""

    def pending(stats: Any) -> int:
        if isinstance(stats, dict):
            return sum(
                int(v) if k == "pending_puts" and isinstance(v, int) else pending(v)
                for k, v in stats.items()
            )
        return 0

    deadline = time.monotonic() + 300.0
    while pending(await client.stats()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


# -- the orchestration ---------------------------------------------------------------------------


def _spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args,
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return
    raise SystemExit(f"a server did not start:\n{''.join(seen)}")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _server_env(root: Path, addr: str, args: argparse.Namespace, encrypt: bool) -> dict[str, str]:
    env = _clean_env()
    env.update(
        PERSISTING_STORAGE_PATH=str(root),
        PERSISTING_MODELS=MODEL,
        PERSISTING_KV__MEMORY_BYTES=str((args.chunks + 8) * args.chunk_mib * MiB * 2),
        PERSISTING_KV__DISK_BYTES=str(16 << 30),
        PERSISTING_KV__DURABILITY=args.durability,
        PERSISTING_SERVICE__ADDR=addr,
        PERSISTING_SERVICE__PASSPHRASE=PASSPHRASE,
        PERSISTING_SERVICE__BULK_ENCRYPTION="true" if encrypt else "false",
        PERSISTING_SERVICE__REQUEST_TIMEOUT_S="120",
    )
    return env


def _run(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Start the servers, run every job of every round in new client processes, stop
    everything; seconds per side, row and round, and the values that came back wrong."""
    hosts = None
    wrap_server: Callable[[list[str]], list[str]] = lambda a: a  # noqa: E731
    wrap_client: Callable[[list[str]], list[str]] = lambda a: a  # noqa: E731
    host = "127.0.0.1"
    if args.network == "veth":
        from tests.netns import TwoHosts

        hosts = TwoHosts("rb").__enter__()
        wrap_server, wrap_client = hosts.in_server, hosts.in_client
        host = hosts.server_ip
    procs: list[subprocess.Popen[str]] = []
    tmp = tempfile.mkdtemp(prefix="persisting-remote-bench-")
    try:
        ports = iter([18610, 18611, 18612] if hosts else [_free_port(host) for _ in range(3)])
        servers = {"persisting": (f"{host}:{next(ports)}", True)}
        if args.plain_too:
            servers["persisting-plain"] = (f"{host}:{next(ports)}", False)
        for side, (addr, encrypt) in servers.items():
            env = _server_env(Path(tmp) / side, addr, args, encrypt)
            server = _spawn(wrap_server([sys.executable, "-m", "actors.launch"]), env)
            procs.append(server)
            _wait_for(server, "data path")
        socket_addr = f"{host}:{next(ports)}"
        sizes = ["--chunks", str(args.chunks), "--chunk-mib", str(args.chunk_mib)]
        role = ["--role", "socket-server", "--bind", socket_addr]
        plain = _spawn(wrap_server([sys.executable, __file__, *role, *sizes]))
        procs.append(plain)
        _wait_for(plain, "READY")
        sides = [*servers, "socket"]
        times: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
        wrong = 0
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for job in ("write-read", "read-settled"):
                for side in order:
                    config = {
                        "job": job,
                        "chunks": args.chunks,
                        "chunk_mib": args.chunk_mib,
                        "seed": r,
                        "batch": args.batch,
                        "settle_s": args.settle_s,
                        "key_base": 1 + r * 10_000,
                        "server": servers[side][0] if side != "socket" else None,
                        "addr": socket_addr,
                    }
                    result = _client(wrap_client, side, config)
                    wrong += int(result["wrong"])
                    for row, seconds in result["seconds"].items():
                        times[side].setdefault(row, []).append(float(seconds))
        return times, wrong
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
        if hosts is not None:
            hosts.remove()


def _client(
    wrap: Callable[[list[str]], list[str]], side: str, config: dict[str, Any]
) -> dict[str, Any]:
    role = "socket-job" if side == "socket" else "persisting-job"
    out = subprocess.run(
        wrap([sys.executable, __file__, "--role", role, json.dumps(config)]),
        env=_clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise SystemExit(f"a {side} job failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")


def _report(args: argparse.Namespace, times: dict[str, dict[str, list[float]]], wrong: int) -> None:
    nbytes = args.chunks * args.chunk_mib * MiB
    print(
        f"\n{args.network}: {args.chunks} chunks of {args.chunk_mib} MiB per row, "
        f"{args.rounds} rounds, batch {args.batch}, durability {args.durability}, a new "
        f"client process per job keeping every value; wrong values: {wrong}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    base = times["socket"]
    print(f"{'side':<17} {'row':<14} {'GB/s':>6} {'socket':>7} {'ratio':>6}  per round")
    for side in times:
        if side == "socket":
            continue
        for row in ROWS:
            ours = times[side][row]
            ratios = [b / o for o, b in zip(ours, base[row], strict=True)]
            print(
                f"{side:<17} {row:<14} {nbytes / statistics.median(ours) / 1e9:>6.2f} "
                f"{nbytes / statistics.median(base[row]) / 1e9:>7.2f} "
                f"{statistics.median(ratios):>5.2f}x  " + " ".join(f"{x:.2f}x" for x in ratios)
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="orchestrate", help=argparse.SUPPRESS)
    parser.add_argument("config", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--bind", help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--durability", default="async", choices=["sync", "async", "write_back"])
    parser.add_argument("--network", default="loopback", choices=["loopback", "veth"])
    parser.add_argument(
        "--plain-too", action="store_true", help="also a server with bulk_encryption off"
    )
    parser.add_argument("--settle-s", type=float, default=1.0)
    args = parser.parse_args()
    if args.role == "socket-server":
        socket_server(args.bind, args.chunk_mib * MiB, args.chunks)
        return
    if args.role in ("socket-job", "persisting-job"):
        config = json.loads(args.config)
        if args.role == "socket-job":
            result = socket_job(config)
        else:
            result = asyncio.run(persisting_job(config))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # Pulsing 0.1.2 may crash at interpreter exit after a shutdown
    times, wrong = _run(args)
    _report(args, times, wrong)
    if wrong:
        raise SystemExit(f"{wrong} values came back wrong")


if __name__ == "__main__":
    main()
