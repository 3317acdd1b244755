"""The store's device path against the physical path of the same bytes (issue 12's GPU rows).

    python benchmarks/device_bench.py [--device cuda] [--chunk-mib 32] [--chunks 8]
        [--rounds 3] [--threads 8] [--settle-s 3] [--json out.json]

Rows, each a median of alternating rounds (the disk let settle before every timed phase):

- ``memory_to_device``: ``batched_get_into(keys, device_outs)`` of memory-tier hits against one
  ``copy_(non_blocking=True)`` per chunk from pinned host tensors (the DMA ceiling);
- ``sync_put_from_device``: ``batched_put`` of device tensors (``durability="sync"``, new
  keys each round) against pinned D2H + write + fsync of each chunk to a file of its own;
- ``cold_disk_to_device``: ``batched_get_into(keys, device_outs)``, page cache dropped,
  against a raw ``preadv`` of the store's own files on ``--threads`` threads into pinned
  buffers, each copied up as it lands.

Both sides fill the same preallocated device tensors; times include a device synchronize
(``batched_get(keys, device=)`` is checked bit-exact once, untimed). ``--device cpu``
runs the same rows without a GPU (pageable memory: a smoke test, not a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_reads import drop_cache, pread_into, settle

from persisting.kv import ChunkKey, open_kv_store
from persisting.kv.disk.payload_files import HEADER_BYTES

MODEL = "bench/device"
MiB = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, 77 + i * 1_000_003, "bfloat16")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:  # type: ignore[no-untyped-def]
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pin = device.type == "cuda"
    nbytes = args.chunk_mib * MiB
    shape = (2, 8, nbytes // (2 * 8 * 1024 * 2), 1024)
    n = args.chunks
    values = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(n)]
    total = n * nbytes
    rows: dict[str, list[float]] = {
        k: [] for k in ("mem_store", "mem_raw", "put_store", "put_raw", "cold_store", "cold_raw")
    }
    budget = 4 * (args.rounds + 2) * total
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        raw_dir = work / "raw"
        raw_dir.mkdir()
        pinned = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin) for _ in range(n)]
        outs = [torch.empty_like(v) for v in values]
        with (
            open_kv_store(
                work / "mem", MODEL, memory_bytes=2 * total, disk_bytes=0, durability="sync"
            ) as mem_store,
            open_kv_store(
                work / "disk",
                MODEL,
                memory_bytes=0,
                disk_bytes=budget,
                durability="sync",
                read_threads=args.threads,
            ) as disk_store,
        ):
            keys = [key(i) for i in range(n)]
            mem_store.batched_put(keys, values)
            disk_store.batched_put(keys, values)
            files = [loc.path for k in keys if (loc := disk_store.lease(k, 0.0)) is not None]
            got = disk_store.batched_get(keys, device=device)
            assert all(torch.equal(g, v) for g, v in zip(got, values, strict=True))
            for p, v in zip(pinned, values, strict=True):
                p.copy_(v)

            def mem_store_get() -> None:
                rows["mem_store"].append(
                    total / timed(device, lambda: mem_store.batched_get_into(keys, outs))
                )

            def mem_raw() -> None:
                def up() -> None:
                    for o, p in zip(outs, pinned, strict=True):
                        o.copy_(p, non_blocking=True)

                rows["mem_raw"].append(total / timed(device, up))

            def put_store(r: int) -> None:
                settle(args.settle_s)
                fresh = [key(1000 * (r + 1) + i) for i in range(n)]
                rows["put_store"].append(
                    total / timed(device, lambda: disk_store.batched_put(fresh, values))
                )

            def put_raw(r: int) -> None:
                settle(args.settle_s)

                def write() -> None:
                    for i, (v, p) in enumerate(zip(values, pinned, strict=True)):
                        p.copy_(v)
                        with open(raw_dir / f"{r}-{i}", "wb") as f:
                            f.write(p.reshape(-1).view(torch.uint8).numpy().data)
                            f.flush()
                            os.fsync(f.fileno())

                rows["put_raw"].append(total / timed(device, write))

            def cold_store() -> None:
                settle(args.settle_s)
                drop_cache(files)
                rows["cold_store"].append(
                    total / timed(device, lambda: disk_store.batched_get_into(keys, outs))
                )

            def cold_raw() -> None:
                settle(args.settle_s)
                drop_cache(files)

                def read() -> None:
                    with ThreadPoolExecutor(args.threads) as pool:
                        futures = [
                            pool.submit(pread_into, f, HEADER_BYTES, p)
                            for f, p in zip(files, pinned, strict=True)
                        ]
                        for future, o, p in zip(futures, outs, pinned, strict=True):
                            future.result()
                            o.copy_(p, non_blocking=True)

                rows["cold_raw"].append(total / timed(device, read))

            for r in range(args.rounds):
                pairs = [
                    (mem_store_get, mem_raw),
                    (lambda r=r: put_store(r), lambda r=r: put_raw(r)),
                    (cold_store, cold_raw),
                ]
                for first, second in pairs:
                    if r % 2:
                        first, second = second, first
                    first()
                    second()
    med = {k: statistics.median(v) / 1e9 for k, v in rows.items()}
    result = {
        "device": str(device),
        "chunk_mib": args.chunk_mib,
        "chunks": n,
        "threads": args.threads,
        **{f"{k}_gbps": round(v, 3) for k, v in med.items()},
        "memory_to_device_ratio": round(med["mem_store"] / med["mem_raw"], 3),
        "sync_put_from_device_ratio": round(med["put_store"] / med["put_raw"], 3),
        "cold_disk_to_device_ratio": round(med["cold_store"] / med["cold_raw"], 3),
        "all_rounds_gbps": {k: [round(x / 1e9, 3) for x in v] for k, v in rows.items()},
    }
    print(
        f"{device}: memory hit to device {med['mem_store']:.2f} GB/s vs pinned copy "
        f"{med['mem_raw']:.2f} -> {result['memory_to_device_ratio']:.2f}x | sync put from device "
        f"{med['put_store']:.2f} vs pinned D2H+write+fsync {med['put_raw']:.2f} -> "
        f"{result['sync_put_from_device_ratio']:.2f}x | cold disk to device "
        f"{med['cold_store']:.2f} vs {args.threads}-thread read + copy {med['cold_raw']:.2f} -> "
        f"{result['cold_disk_to_device_ratio']:.2f}x",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
