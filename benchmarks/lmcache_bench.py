"""LMCache storage-backend I/O: LocalDiskBackend vs PersistingKVBackend, same workload.

Two harnesses, run one after the other (``--mode``, default ``both``):

- ``shipped``: LMCache 0.5.6's own ``storage_backend_io`` harness, as shipped in its sdist
  (fetched with pip into a cache on first use: see ``benchmarks/lmcache_harness.py``),
  each run a fresh process, LocalDisk and the plugin alternating: reads land in the fresh
  tensors LMCache's ``AdHocMemoryAllocator`` allocates, as that harness has them. Chunks
  are its ``kv_shape (28, 2, 256, 8, 128)`` bfloat16 (28 MiB), ``--shipped-ops`` of them,
  ``--concurrency`` threads; ``--shipped-chunk`` changes the chunk's token count.
- ``resident``: the independent harness below, whose reads land in one preallocated,
  faulted-in buffer (``--staging resident``, as LMCache deploys its CPU backend).

The resident harness, modelled on LMCache's (an independent harness with the same method,
not a copy): ``--num-ops`` chunks are submitted with ``batched_submit_put_task``
from ``--concurrency`` threads (one slice each) and the write is timed until every key's
``on_complete_callback`` has fired; the read times ``get_blocking`` of every key from the
same number of threads, and each chunk read is then compared byte for byte with what was
written (integrity errors are counted, misses included). Each round then opens a new backend
on the same directory and counts the chunks it still finds ("found after restart").

Both backends get a ``LocalCPUBackend`` staging allocator, a fresh directory and fresh keys
per round, and run alternately (the first backend swaps each round), so page-cache and
disk state favour neither; the disk is settled (``os.sync()`` and ``--pause`` seconds)
before each timed phase, since this machine's disk keeps flushing after a write and slows
whatever comes next. The read is warm: it follows the write, as LMCache's harness does
(LocalDiskBackend reads from the page cache, the plugin from its memory tier when it has
one). The default chunk is LMCache's shape for ``kv_shape (28, 2, 256, 8, 128)``
bfloat16 (``[2, 28, 256, 1024]``, 28 MiB, KV_2LTD). Throughputs are medians over rounds;
each ratio (Persisting / LocalDisk, > 1 means Persisting is faster) is the median of the
per-round ratios (the two backends of a round run back to back).

    .venv/bin/python benchmarks/lmcache_bench.py                 # both harnesses (~5-10 min)
    .venv/bin/python benchmarks/lmcache_bench.py --mode shipped  # LMCache's own harness only
    .venv/bin/python benchmarks/lmcache_bench.py --shape 2,16,8,128 --fmt KV_T2D \\
        --num-ops 256 --concurrency 16                           # LMCache's harness shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

from persisting.lmcache_backend import PersistingKVBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lmcache_harness

MODEL = "meta-llama/Llama-3-8B"
DTYPE = torch.bfloat16


def _start_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-loop", daemon=True)
    thread.start()
    return loop, thread


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def _metadata(kv_shape: tuple[int, int, int, int, int]) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=kv_shape,
    )


def _staging_allocator(staging: str, nbytes: int) -> Any:
    """The allocator of the ``LocalCPUBackend`` reads land in.

    ``resident`` (default): one buffer of ``nbytes`` faulted in before the round, as
    LMCache's own CPU backend preallocates (and, with CUDA, pins) its whole buffer; a read
    then measures the backend, not the kernel zeroing fresh destination pages. ``adhoc``:
    a fresh tensor per read (AdHocMemoryAllocator), as this harness did before: every read
    then also pays the kernel faulting and zeroing its destination's pages, on either
    side, which is the machine's cost and not the backend's.
    """
    if staging == "adhoc":
        return AdHocMemoryAllocator(device="cpu")
    allocator = HostMemoryAllocator(nbytes)
    allocator.allocator.buffer.fill_(0)  # type: ignore[attr-defined]
    return allocator


def _make_backend(
    name: str,
    directory: Path,
    metadata: LMCacheMetadata,
    loop: asyncio.AbstractEventLoop,
    persisting_options: dict[str, Any],
    staging: str = "adhoc",
    staging_bytes: int = 0,
) -> tuple[StorageBackendInterface, LocalCPUBackend]:
    extra: dict[str, Any] = {}
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=metadata.kv_shape[2],
        local_cpu=True,
        max_local_cpu_size=0.1,
        lmcache_instance_id=f"bench_{name}_{time.time_ns()}",
    )
    if name == "local_disk":
        config.local_disk = str(directory) + "/"
        config.max_local_disk_size = 64.0
    else:
        extra = {"persisting.storage_path": str(directory), **persisting_options}
    config.extra_config = extra
    cpu = LocalCPUBackend(
        config=config,
        metadata=metadata,
        dst_device="cpu",
        memory_allocator=_staging_allocator(staging, staging_bytes),
    )
    backend: StorageBackendInterface
    if name == "local_disk":
        backend = LocalDiskBackend(
            config=config, loop=loop, local_cpu_backend=cpu, dst_device="cpu", metadata=metadata
        )
    else:
        backend = PersistingKVBackend(
            config=config, dst_device="cpu", metadata=metadata, local_cpu_backend=cpu, loop=loop
        )
    return backend, cpu


def _make_objects(n: int, shape: torch.Size, fmt: MemoryFormat, seed: int) -> list[MemoryObj]:
    allocator = AdHocMemoryAllocator(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    objs = []
    for _ in range(n):
        obj = allocator.allocate([shape], [DTYPE], fmt=fmt)
        assert obj is not None and obj.tensor is not None
        obj.raw_data.copy_(
            torch.randint(0, 256, obj.raw_data.shape, dtype=torch.uint8, generator=gen)
        )
        objs.append(obj)
    return objs


def _slices(n: int, parts: int) -> list[tuple[int, int]]:
    size = max(1, -(-n // parts))
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _timed_writes(
    backend: StorageBackendInterface,
    keys: list[CacheEngineKey],
    objs: list[MemoryObj],
    concurrency: int,
    timeout_s: float,
) -> float:
    done = threading.Event()
    completed = 0
    lock = threading.Lock()

    def on_complete(_key: CacheEngineKey) -> None:
        nonlocal completed
        with lock:
            completed += 1
            if completed >= len(keys):
                done.set()

    def submit(span: tuple[int, int]) -> None:
        a, b = span
        backend.batched_submit_put_task(keys[a:b], objs[a:b], on_complete_callback=on_complete)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(submit, _slices(len(keys), concurrency)))
    if not done.wait(timeout_s):
        raise TimeoutError(f"only {completed} of {len(keys)} puts completed in {timeout_s}s")
    return time.perf_counter() - start


def _timed_reads(
    backend: StorageBackendInterface,
    keys: list[CacheEngineKey],
    concurrency: int,
) -> tuple[float, list[MemoryObj | None]]:
    results: list[MemoryObj | None] = [None] * len(keys)

    def read(span: tuple[int, int]) -> None:
        for i in range(*span):
            results[i] = backend.get_blocking(keys[i])

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(read, _slices(len(keys), concurrency)))
    return time.perf_counter() - start, results


def settle(seconds: float) -> None:
    """Let the disk finish what earlier phases wrote before the next timed phase."""
    os.sync()
    time.sleep(seconds)


def _integrity_errors(objs: list[MemoryObj], got: list[MemoryObj | None]) -> int:
    errors = 0
    for want, have in zip(objs, got, strict=True):
        if have is None or not torch.equal(have.raw_data[: want.get_size()], want.raw_data):
            errors += 1
        if have is not None:
            have.ref_count_down()
    return errors


def run_one(
    name: str,
    args: argparse.Namespace,
    round_no: int,
    base: Path,
    persisting_options: dict[str, Any],
) -> dict[str, Any]:
    """One backend, one round: fresh directory, fresh keys, write then read."""
    shape = torch.Size(args.shape)
    fmt = MemoryFormat[args.fmt]
    kv_shape = (
        (shape[1], shape[0], shape[2], 8, shape[3] // 8) if len(shape) == 4 else (4, 2, 256, 8, 128)
    )
    metadata = _metadata(kv_shape)  # type: ignore[arg-type]
    directory = base / f"{name}-{round_no}"
    directory.mkdir(parents=True)
    loop, thread = _start_loop()
    staging_bytes = (args.num_ops + 2) * shape.numel() * DTYPE.itemsize + (16 << 20)
    backend, cpu = _make_backend(
        name, directory, metadata, loop, persisting_options, args.staging, staging_bytes
    )
    try:
        keys = [
            CacheEngineKey(MODEL, 1, 0, (round_no << 40) + i - (1 << 62), DTYPE)
            for i in range(args.num_ops)
        ]
        objs = _make_objects(args.num_ops, shape, fmt, seed=round_no)
        first = objs[0].raw_data.clone()
        settle(args.pause)
        prefaulted = 0  # of the plugin's memory tier when the timed write starts
        if isinstance(backend, PersistingKVBackend):
            prefaulted = backend.store_for(keys[0]).prefaulted_bytes()
        write_s = _timed_writes(backend, keys, objs, args.concurrency, args.timeout)
        settle_s = 0.0
        if args.settle and isinstance(backend, PersistingKVBackend):
            start = time.perf_counter()
            backend.flush()  # let write-behind reach the disk before reading (not timed)
            settle_s = time.perf_counter() - start
        settle(args.pause)
        read_s, got = _timed_reads(backend, keys, args.concurrency)
        errors = _integrity_errors(objs, got)
        for obj in objs:
            obj.ref_count_down()
    finally:
        backend.close()
        cpu.close()
        _stop_loop(loop, thread)
    try:
        recovered = _recovered_after_restart(
            name, directory, metadata, persisting_options, keys, first
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    mib = args.num_ops * shape.numel() * DTYPE.itemsize / (1 << 20)
    return {
        "backend": name,
        "round": round_no,
        "write_s": write_s,
        "read_s": read_s,
        "write_ops_s": args.num_ops / write_s,
        "read_ops_s": args.num_ops / read_s,
        "write_mib_s": mib / write_s,
        "read_mib_s": mib / read_s,
        "integrity_errors": errors,
        "settle_s": settle_s,
        "prefaulted_mib": prefaulted / (1 << 20),
        "recovered_after_restart": recovered,
    }


def _recovered_after_restart(
    name: str,
    directory: Path,
    metadata: LMCacheMetadata,
    persisting_options: dict[str, Any],
    keys: list[CacheEngineKey],
    first: torch.Tensor,
) -> int:
    """Chunks a new backend on the same directory finds (the first one checked bit-exact)."""
    loop, thread = _start_loop()
    backend, cpu = _make_backend(name, directory, metadata, loop, persisting_options)
    try:
        found = sum(backend.contains(k) for k in keys)
        if found:
            obj = backend.get_blocking(keys[0])
            if obj is None or not torch.equal(obj.raw_data[: first.numel()], first):
                found = -1  # found but wrong: reported as a failure
            if obj is not None:
                obj.ref_count_down()
        return found
    finally:
        backend.close()
        cpu.close()
        _stop_loop(loop, thread)


def _summary(results: list[dict[str, Any]], name: str) -> dict[str, float]:
    mine = [r for r in results if r["backend"] == name]
    return {
        "write_mib_s": statistics.median(r["write_mib_s"] for r in mine),
        "read_mib_s": statistics.median(r["read_mib_s"] for r in mine),
        "write_ops_s": statistics.median(r["write_ops_s"] for r in mine),
        "read_ops_s": statistics.median(r["read_ops_s"] for r in mine),
        "integrity_errors": sum(r["integrity_errors"] for r in mine),
        "recovered_after_restart": min(r["recovered_after_restart"] for r in mine),
    }


def _round_ratio(results: list[dict[str, Any]], field: str) -> float:
    """Median over rounds of Persisting's ``field`` / LocalDisk's in the same round."""
    disk = {r["round"]: r[field] for r in results if r["backend"] == "local_disk"}
    return statistics.median(
        r[field] / disk[r["round"]] for r in results if r["backend"] == "persisting"
    )


def run_shipped(args: argparse.Namespace, base: Path, options: dict[str, Any]) -> dict[str, Any]:
    """LMCache's own harness, LocalDisk and the plugin alternating, a fresh process each."""
    lmcache_harness.harness_path()  # fetched (or found) before any clock starts
    runs: list[dict[str, Any]] = []
    order = ["local_disk", "persisting"]
    for round_no in range(args.rounds):
        for name in order if round_no % 2 == 0 else order[::-1]:
            directory = base / f"shipped-{name}-{round_no}"
            directory.mkdir(parents=True)
            settle(args.pause)
            try:
                result = lmcache_harness.run_child(
                    name,
                    directory,
                    args.shipped_ops,
                    args.concurrency,
                    args.shipped_chunk,
                    options if name == "persisting" else {},
                )
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            result["name"], result["round"] = name, round_no
            runs.append(result)
            print(
                f"shipped round {round_no} {name:>10}: write {result['write_ops_per_sec']:7.1f}"
                f" ops/s  read {result['read_ops_per_sec']:7.1f} ops/s  integrity errors "
                f"{result['integrity_errors']}  (load average {result['load_average']:.1f})",
                flush=True,
            )

    def ratio(field: str) -> float:
        disk = {r["round"]: r[field] for r in runs if r["name"] == "local_disk"}
        return statistics.median(
            r[field] / disk[r["round"]] for r in runs if r["name"] == "persisting"
        )

    def median(name: str, field: str) -> float:
        return statistics.median(r[field] for r in runs if r["name"] == name)

    summary = {
        "runs": runs,
        "write_ratio": ratio("write_ops_per_sec"),
        "read_ratio": ratio("read_ops_per_sec"),
        "integrity_errors": sum(r["integrity_errors"] for r in runs),
    }
    for name in order:
        summary[name] = {f: median(name, f) for f in ("write_ops_per_sec", "read_ops_per_sec")}
    print(
        f"\nLMCache's storage_backend_io harness as shipped ({args.shipped_ops} ops, chunk "
        f"{args.shipped_chunk} tokens, concurrency {args.concurrency}, {args.rounds} rounds),"
        f" medians: LocalDisk write {summary['local_disk']['write_ops_per_sec']:.1f} read "
        f"{summary['local_disk']['read_ops_per_sec']:.1f} ops/s; Persisting write "
        f"{summary['persisting']['write_ops_per_sec']:.1f} read "
        f"{summary['persisting']['read_ops_per_sec']:.1f} ops/s; ratio (median of per-round "
        f"ratios) write {summary['write_ratio']:.2f}x read {summary['read_ratio']:.2f}x; "
        f"integrity errors {summary['integrity_errors']}",
        flush=True,
    )
    return summary


def run_resident(args: argparse.Namespace, base: Path, options: dict[str, Any]) -> dict[str, Any]:
    """The independent harness (``--staging``), LocalDisk and the plugin alternating."""
    results: list[dict[str, Any]] = []
    order = ["local_disk", "persisting"]
    for round_no in range(args.rounds):
        for name in order if round_no % 2 == 0 else order[::-1]:
            result = run_one(name, args, round_no, base, options)
            results.append(result)
            print(
                f"round {round_no} {name:>10}: write {result['write_mib_s']:8.1f} MiB/s "
                f"({result['write_ops_s']:7.1f} ops/s)  read {result['read_mib_s']:8.1f} "
                f"MiB/s ({result['read_ops_s']:7.1f} ops/s)  "
                f"integrity errors {result['integrity_errors']}  "
                f"found after restart {result['recovered_after_restart']}/{args.num_ops}",
                flush=True,
            )
    disk, ours = _summary(results, "local_disk"), _summary(results, "persisting")
    print(
        f"\nchunk {list(args.shape)} {args.fmt} bfloat16, {args.num_ops} ops x "
        f"{args.rounds} rounds, concurrency {args.concurrency}, staging {args.staging}, medians:"
    )
    for label, s in (("LocalDiskBackend", disk), ("PersistingKVBackend", ours)):
        print(
            f"  {label:<20} write {s['write_mib_s']:8.1f} MiB/s  read {s['read_mib_s']:8.1f} "
            f"MiB/s  integrity errors {s['integrity_errors']}  "
            f"found after restart {s['recovered_after_restart']}/{args.num_ops}"
        )
    write_ratio = _round_ratio(results, "write_mib_s")
    read_ratio = _round_ratio(results, "read_mib_s")
    print(
        f"  ratio Persisting/LocalDisk (median of per-round ratios): "
        f"write {write_ratio:.2f}x  read {read_ratio:.2f}x",
        flush=True,
    )
    return {
        "runs": results,
        "local_disk": disk,
        "persisting": ours,
        "write_ratio": write_ratio,
        "read_ratio": read_ratio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode",
        choices=["both", "shipped", "resident"],
        default="both",
        help="LMCache's harness as shipped, the resident-staging harness, or both",
    )
    parser.add_argument(
        "--shipped-ops", type=int, default=48, help="chunks per run of LMCache's harness"
    )
    parser.add_argument(
        "--shipped-chunk",
        type=int,
        default=256,
        help="tokens per chunk in LMCache's harness (its kv_shape (28, 2, chunk, 8, 128))",
    )
    parser.add_argument("--num-ops", type=int, default=24, help="chunks per round")
    parser.add_argument("--concurrency", type=int, default=4, help="submitting/reading threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shape",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(2, 28, 256, 1024),
        help="chunk shape (default: LMCache's KV_2LTD chunk of kv_shape (28,2,256,8,128))",
    )
    parser.add_argument("--fmt", default="KV_2LTD", choices=[f.name for f in MemoryFormat])
    parser.add_argument(
        "--staging",
        default="resident",
        choices=["resident", "adhoc"],
        help="LMCache CPU allocator reads land in: one preallocated, faulted-in buffer "
        "(as LMCache deploys it) or a fresh tensor per read",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--persisting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra_config for the plugin, e.g. --persisting persisting.memory_bytes=0",
    )
    parser.add_argument(
        "--settle",
        action="store_true",
        help="wait (untimed) for the plugin's write-behind to reach disk before reading",
    )
    parser.add_argument(
        "--pause", type=float, default=5.0, help="seconds after os.sync() before each phase"
    )
    parser.add_argument("--json", default=None, help="also write all results to this file")
    args = parser.parse_args(argv)
    persisting_options = dict(item.split("=", 1) for item in args.persisting)

    base = Path(tempfile.mkdtemp(prefix="lmcache-bench-", dir=args.dir))
    out: dict[str, Any] = {"load_average_start": os.getloadavg()[0]}
    try:
        if args.mode in ("shipped", "both"):
            out["shipped"] = run_shipped(args, base, persisting_options)
        if args.mode in ("resident", "both"):
            out["resident"] = run_resident(args, base, persisting_options)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out["load_average_end"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    failed = False
    if "shipped" in out:
        failed = failed or out["shipped"]["integrity_errors"] > 0
    if "resident" in out:
        disk, ours = out["resident"]["local_disk"], out["resident"]["persisting"]
        failed = failed or disk["integrity_errors"] or ours["integrity_errors"]
        failed = failed or ours["recovered_after_restart"] != args.num_ops
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
