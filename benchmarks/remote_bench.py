"""Remote gets and puts: a client on another host through the bulk data path, against a plain
TCP socket moving the same bytes between two processes and against Mooncake Store.

Three sides move the same number of 8 MiB chunks (default) per phase, in one run:

* **persisting** -- ``persisting serve --passphrase ...`` (``python -m
  actors.launch``) in its own process, a ``KVCacheClient.connect(...,
  same_host=False)`` in the client process: ``put`` one by one, ``get`` one by one (values
  kept until the phase ends, as a caller keeps them), ``get_into`` preallocated tensors,
  and ``batched_get`` of ``--batch``;
* **socket** -- the baseline: one TCP connection between the client process and a server
  process, the server's chunks preallocated, the client receiving into preallocated
  buffers with ``recv_into`` (``MSG_WAITALL``) and sending from the values' own memory;
  a put is acknowledged with one byte, a get asks with a 9-byte request, so both make
  one round trip per chunk (per batch for the batched row), as the service does;
* **mooncake** (with ``--mooncake-python``) -- Mooncake Store 0.3.13 over TCP: a master
  and a storage process on the server's host, a client on the client's (it contributes no
  memory: every value lives in the storage process): ``put_from``, ``get_into`` and
  ``batch_get_into`` on registered buffers (``benchmarks/mooncake_side.py``, run by the
  Python of a separate venv).

Per round, each phase (put, get, get_into, batched get) times each side once, the sides
taking turns going first; before each timed side the server's writes behind earlier puts
are waited for (``pending_puts`` of its stats) and the disk is let settle (``os.sync()``
and a pause). Every value read is compared with what was put, after the timing; a wrong
value fails the run. Rows print the median over rounds of each side's GB/s and the median
per-round ratio to the socket.

``--network loopback`` runs everything on this host; ``--network veth`` puts the servers in
one network namespace and the clients in another, joined by a veth pair (needs root;
the namespaces are made and removed by the run); ``both`` runs one after the other.

    .venv/bin/python benchmarks/remote_bench.py [--chunks 16] [--chunk-mib 8] [--rounds 5]
        [--batch 8] [--durability async] [--sealed] [--network loopback|veth|both]
        [--mooncake-python /path/to/venv/bin/python] [--settle-s 1] [--bulk-poll-us N]
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from persisting.config import PersistingSettings  # noqa: E402
from persisting.kv import ChunkKey  # noqa: E402
from persisting.service import KVCacheClient  # noqa: E402
from persisting.shm import aligned_buffer  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from service_bench import _values  # noqa: E402  (the same 8 MiB chunks)

MODEL = "bench/remote-8mib"
PASSPHRASE = "remote-bench-passphrase"
MiB = 1 << 20
_COMMAND = struct.Struct("<cII")  # op, first chunk, count
PHASES = ("put", "get", "get_into", "batched_get")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# -- the plain socket ------------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def socket_server(bind: str, nbytes: int, chunks: int) -> None:
    """The baseline's server: preallocated chunks, sent on request, received and acked."""
    host, port = bind.rsplit(":", 1)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    listener.listen(1)
    print("READY", flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = np.random.default_rng(3)
    buffers = [aligned_buffer(nbytes) for _ in range(chunks)]
    for b in buffers:
        b[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    command = bytearray(_COMMAND.size)
    while True:
        try:
            _recv_exactly(conn, memoryview(command))
        except ConnectionError:
            return
        op, first, count = _COMMAND.unpack(command)
        if op == b"g":
            for b in buffers[first : first + count]:
                conn.sendall(b.data)
        else:
            for b in buffers[first : first + count]:
                _recv_exactly(conn, b.data.cast("B"))
            conn.sendall(b"k")


class SocketSide:
    """The baseline's client (see the module docstring)."""

    def __init__(self, addr: str, values: list[torch.Tensor]):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sources = [v.view(-1).view(torch.uint8).numpy().data for v in values]
        self.nbytes = len(self.sources[0])
        self.outs = [aligned_buffer(self.nbytes) for _ in values]

    def put(self) -> int:
        ack = bytearray(1)
        for i, source in enumerate(self.sources):
            self.sock.sendall(_COMMAND.pack(b"p", i, 1))
            self.sock.sendall(source)
            _recv_exactly(self.sock, memoryview(ack))
        return 0

    def get(self, batch: int = 1) -> int:
        for first in range(0, len(self.outs), batch):
            count = min(batch, len(self.outs) - first)
            self.sock.sendall(_COMMAND.pack(b"g", first, count))
            for out in self.outs[first : first + count]:
                _recv_exactly(self.sock, out.data.cast("B"))
        return 0


# -- Mooncake Store ---------------------------------------------------------------------------


class MooncakeSide:
    """Commands to ``mooncake_side.py client`` (run in the client's network namespace)."""

    def __init__(self, python: str, host: str, master: str, nbytes: int, chunks: int):
        self.proc = subprocess.Popen(
            [
                python,
                str(REPO / "benchmarks" / "mooncake_side.py"),
                "client",
                host,
                master,
                str(nbytes),
                str(chunks),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        _ready(self.proc, "mooncake client")

    def run(self, op: str, round_: int, batch: int = 1) -> tuple[float, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "round": round_, "batch": batch}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return float(answer["seconds"]), int(answer["wrong"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _ready(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY"):
            return
    raise SystemExit(f"{what} did not start (exit {proc.wait()})")


# -- the client process ------------------------------------------------------------------------


def _pending_puts(stats: Any) -> int:
    """Puts the servers have not written to disk yet (every ``pending_puts`` in ``stats``)."""
    if isinstance(stats, dict):
        return sum(
            int(v) if k == "pending_puts" and isinstance(v, int) else _pending_puts(v)
            for k, v in stats.items()
        )
    if isinstance(stats, list):
        return sum(_pending_puts(v) for v in stats)
    return 0


async def _settle(client: KVCacheClient, seconds: float) -> None:
    """Before a timed side: the server's writes behind earlier puts done (they would slow
    whichever side came next), the disk flushed, a pause."""
    deadline = time.monotonic() + 120.0
    while _pending_puts(await client.stats()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    os.sync()
    time.sleep(seconds)


async def _client(config: dict[str, Any]) -> dict[str, Any]:
    """Every phase of every round, each side in turn; per side and phase, seconds per round."""
    values = _values(config["chunks"], config["chunk_mib"])
    nbytes = values[0].numel() * values[0].element_size()
    service: dict[str, Any] = {"request_timeout_s": 60.0, "bulk_sealed": config["sealed"]}
    if config["bulk_poll_us"] is not None:
        service["bulk_poll_us"] = config["bulk_poll_us"]
    settings = PersistingSettings(models=[MODEL], service=service)
    client = await KVCacheClient.connect(
        seeds=[config["server"]],
        model=MODEL,
        passphrase=PASSPHRASE,
        settings=settings,
        same_host=False,
    )
    plain = SocketSide(config["socket"], values)
    mooncake = None
    if config.get("mooncake_python"):
        mooncake = MooncakeSide(
            config["mooncake_python"],
            config["client_host"],
            config["mooncake_master"],
            nbytes,
            len(values),
        )
    outs = [torch.empty_like(v) for v in values]
    times: dict[str, dict[str, list[float]]] = {}
    wrong = 0
    sides = ["persisting", "socket"] + (["mooncake"] if mooncake else [])
    batch = config["batch"]

    def record(side: str, phase: str, seconds: float) -> None:
        times.setdefault(side, {}).setdefault(phase, []).append(seconds)

    try:
        # Warm-up, not timed: the data connections open, and the server's memory tier has
        # been written once (a pool page's first use commits and faults it in: a one-time
        # cost of a fresh server, which the socket's preallocated buffers never pay).
        warm = [ChunkKey(MODEL, 1, 0, 10_000_000 + i, "bfloat16") for i in range(len(values))]
        await client.batched_put(warm, values)
        await client.batched_get(warm)
        await client.batched_remove(warm)
        plain.put()
        plain.get()
        for r in range(config["rounds"]):
            keys = [ChunkKey(MODEL, 1, 0, 1 + r * 1000 + i, "bfloat16") for i in range(len(values))]
            for p, phase in enumerate(PHASES):
                order = sides[(r + p) % len(sides) :] + sides[: (r + p) % len(sides)]
                for side in order:
                    await _settle(client, config["settle_s"])
                    if side == "persisting":
                        seconds, bad = await _persisting_phase(
                            client, phase, keys, values, outs, batch
                        )
                    elif side == "socket":
                        start = time.perf_counter()
                        plain.put() if phase == "put" else plain.get(
                            batch if phase == "batched_get" else 1
                        )
                        seconds, bad = time.perf_counter() - start, 0
                    else:
                        assert mooncake is not None
                        op = {"get_into": "get", "batched_get": "batch_get"}.get(phase, phase)
                        seconds, bad = mooncake.run(op, r, batch)
                    record(side, phase, seconds)
                    wrong += bad
            await client.batched_remove(keys)
            if mooncake is not None:
                mooncake.run("remove", r)
        stats = client.counters
        return {
            "times": times,
            "wrong": wrong,
            "nbytes": nbytes * len(values),
            "client": dict(stats),
        }
    finally:
        if mooncake is not None:
            mooncake.close()
        await client.close()


async def _persisting_phase(
    client: KVCacheClient,
    phase: str,
    keys: list[ChunkKey],
    values: list[torch.Tensor],
    outs: list[torch.Tensor],
    batch: int,
) -> tuple[float, int]:
    """One timed phase through the service; (seconds, values that came back wrong)."""
    got: list[Any] = []
    start = time.perf_counter()
    if phase == "put":
        for k, v in zip(keys, values, strict=True):
            await client.put(k, v)
    elif phase == "get":
        for k in keys:
            got.append(await client.get(k))  # kept, as a caller keeps them
    elif phase == "get_into":
        for k, out in zip(keys, outs, strict=True):
            got.append(await client.get_into(k, out))
    else:
        for first in range(0, len(keys), batch):
            got.extend(await client.batched_get(keys[first : first + batch]))
    seconds = time.perf_counter() - start
    if phase == "put":
        return seconds, 0
    if phase == "get_into":
        got = [out if layout is not None else None for out, layout in zip(outs, got, strict=True)]
    wrong = sum(g is None or not torch.equal(g, v) for g, v in zip(got, values, strict=True))
    for out in outs:
        out.zero_()
    return seconds, wrong


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


def _server_env(root: Path, addr: str, args: argparse.Namespace, memory: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env.update(
        PYTHONPATH=str(REPO),
        PERSISTING_STORAGE_PATH=str(root),
        PERSISTING_MODELS=MODEL,
        PERSISTING_KV__MEMORY_BYTES=str(memory),
        PERSISTING_KV__DISK_BYTES=str(8 << 30),
        PERSISTING_KV__DURABILITY=args.durability,
        PERSISTING_SERVICE__ADDR=addr,
        PERSISTING_SERVICE__PASSPHRASE=PASSPHRASE,
        PERSISTING_SERVICE__BULK_SEALED="true" if args.sealed else "false",
        PERSISTING_SERVICE__REQUEST_TIMEOUT_S="60",
    )
    if args.bulk_poll_us is not None:
        env["PERSISTING_SERVICE__BULK_POLL_US"] = str(args.bulk_poll_us)
    return env


def _wait_for(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return
    raise SystemExit(f"a server did not start:\n{''.join(seen)}")


def _run_network(args: argparse.Namespace, network: str) -> dict[str, Any]:
    """Start the servers (in the server's namespace for veth), run the client side (in the
    client's), stop everything; the client side's result."""
    hosts = None
    wrap_server: Callable[[list[str]], list[str]] = lambda a: a  # noqa: E731
    wrap_client: Callable[[list[str]], list[str]] = lambda a: a  # noqa: E731
    server_host = client_host = "127.0.0.1"
    if network == "veth":
        from tests.netns import TwoHosts

        hosts = TwoHosts("rb").__enter__()
        wrap_server, wrap_client = hosts.in_server, hosts.in_client
        server_host, client_host = hosts.server_ip, hosts.client_ip
    procs: list[subprocess.Popen[str]] = []
    nbytes = args.chunk_mib * MiB
    # Not a TemporaryDirectory: the servers must be stopped before their root is removed
    # (a live server still writes its metadata there).
    tmp = tempfile.mkdtemp(prefix="persisting-remote-bench-")
    try:
        # fresh namespaces have every port free; on loopback, ask for free ones
        ports = [18610, 18611, 18612] if hosts else [_free_port(server_host) for _ in range(3)]
        port, socket_port, master_port = ports
        addr = f"{server_host}:{port}"
        memory = (args.chunks + 8) * nbytes * 2
        server = _spawn(
            wrap_server([sys.executable, "-m", "actors.launch"]),
            _server_env(Path(tmp) / "root", addr, args, memory),
        )
        procs.append(server)
        _wait_for(server, "data path")
        plain = _spawn(
            wrap_server(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "socket-server",
                    "--bind",
                    f"{server_host}:{socket_port}",
                    "--chunks",
                    str(args.chunks),
                    "--chunk-mib",
                    str(args.chunk_mib),
                ]
            )
        )
        procs.append(plain)
        _ready(plain, "socket server")
        master = f"{server_host}:{master_port}"
        if args.mooncake_python:
            bin_dir = Path(args.mooncake_python).parent
            procs.append(
                _spawn(wrap_server([str(bin_dir / "mooncake_master"), f"--port={master_port}"]))
            )
            time.sleep(2.0)
            storage = _spawn(
                wrap_server(
                    [
                        args.mooncake_python,
                        str(REPO / "benchmarks" / "mooncake_side.py"),
                        "storage",
                        server_host,
                        master,
                        str(memory),
                    ]
                )
            )
            procs.append(storage)
            _ready(storage, "mooncake storage")
        config = {
            "server": addr,
            "socket": f"{server_host}:{socket_port}",
            "client_host": client_host,
            "mooncake_master": master,
            "mooncake_python": args.mooncake_python,
            "chunks": args.chunks,
            "chunk_mib": args.chunk_mib,
            "rounds": args.rounds,
            "batch": args.batch,
            "settle_s": args.settle_s,
            "sealed": args.sealed,
            "bulk_poll_us": args.bulk_poll_us,
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
        env["PYTHONPATH"] = str(REPO)
        out = subprocess.run(
            wrap_client([sys.executable, __file__, "--role", "client", json.dumps(config)]),
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                return dict(json.loads(line[7:]))
        raise SystemExit(f"the client side failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
        if hosts is not None:
            hosts.remove()


def _report(network: str, result: dict[str, Any], args: argparse.Namespace) -> None:
    times = result["times"]
    nbytes = result["nbytes"]
    print(
        f"\n{network}: {args.chunks} chunks of {args.chunk_mib} MiB per phase, {args.rounds} "
        f"rounds, batch {args.batch}, durability {args.durability}, "
        f"{'sealed' if args.sealed else 'plain'} data path, bulk_poll_us "
        f"{'default' if args.bulk_poll_us is None else args.bulk_poll_us}; "
        f"wrong values: {result['wrong']}"
    )
    print(
        f"{'phase':<12} {'persisting':>11} {'socket':>9} {'ratio':>7} {'mooncake':>9} {'ratio':>7}"
    )
    for phase in PHASES:
        ours, base = times["persisting"][phase], times["socket"][phase]
        ratio = statistics.median(b / o for o, b in zip(ours, base, strict=True))
        row = (
            f"{phase:<12} {nbytes / statistics.median(ours) / 1e9:>8.2f} GB/s"
            f" {nbytes / statistics.median(base) / 1e9:>6.2f} GB/s {ratio:>6.2f}x"
        )
        if "mooncake" in times:
            theirs = times["mooncake"][phase]
            versus = statistics.median(b / m for m, b in zip(theirs, base, strict=True))
            row += f" {nbytes / statistics.median(theirs) / 1e9:>6.2f} GB/s {versus:>6.2f}x"
        print(row)
    print("per round, persisting / socket:")
    for phase in PHASES:
        ours, base = times["persisting"][phase], times["socket"][phase]
        ratios = " ".join(f"{b / o:.2f}x" for o, b in zip(ours, base, strict=True))
        print(f"  {phase:<12} {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="orchestrate", help=argparse.SUPPRESS)
    parser.add_argument("config", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--bind", help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--durability", default="async", choices=["sync", "async", "write_back"])
    parser.add_argument("--sealed", action="store_true", help="encrypt the data path")
    parser.add_argument("--network", default="loopback", choices=["loopback", "veth", "both"])
    parser.add_argument("--mooncake-python", help="Python of a venv with Mooncake installed")
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument(
        "--bulk-poll-us",
        type=int,
        help="service.bulk_poll_us of the server and the client (default: the setting's)",
    )
    args = parser.parse_args()
    if args.role == "socket-server":
        socket_server(args.bind, args.chunk_mib * MiB, args.chunks)
        return
    if args.role == "client":
        result = asyncio.run(_client(json.loads(args.config)))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # Pulsing 0.1.2 may crash at interpreter exit after a shutdown
    networks = ["loopback", "veth"] if args.network == "both" else [args.network]
    failed = False
    for network in networks:
        result = _run_network(args, network)
        _report(network, result, args)
        failed = failed or result["wrong"] > 0
    if failed:
        raise SystemExit("some values came back wrong")


if __name__ == "__main__":
    main()
