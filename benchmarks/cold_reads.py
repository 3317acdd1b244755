"""Cold reads from disk against raw reads of the same bytes, measured as an independent
check would (issues 12 and 17).

    .venv/bin/python benchmarks/cold_reads.py [--chunks 16] [--shape 2 16 256 512]
        [--rounds 5] [--threads 8] [--settle-s 5] [--profile] [--json out.json]

Two rows, each a median of ``--rounds`` alternating rounds (the side that goes first
alternates). Before every timed phase the disk is let settle (``os.sync()`` and a pause of
``--settle-s``: the virtual disks here keep flushing long after fsync returns and slow
whatever comes next 3-4x) and the page cache of that side's files is dropped
(``posix_fadvise(DONTNEED)``).

- ``fresh_process``: 16 chunks of ``[2, 16, 256, 512]`` bf16 (8 MiB) put with
  ``store.put`` into a store with ``memory_bytes=0, durability="sync"``; the raw side
  writes each chunk's bytes to a file of its own (buffered write, flush, fsync). A NEW
  PROCESS then opens the store and gets each key once, against a new process reading each
  raw file into a freshly allocated tensor. Times are of the gets and the reads (torch is
  imported and the store opened before the clock starts; the open is reported apart).
- ``batched``: one ``store.batched_get`` of the same chunks (``read_threads = --threads``,
  fresh result buffers) against a raw ``preadv`` of the store's own payload files into
  fresh tensors on a pool of the same number of threads.

``--profile`` also runs the fresh-process get under cProfile and prints where its time goes.
Ratios > 1 mean faster than the raw read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from persisting.kv import ChunkKey, open_kv_store
from persisting.kv.payload_files import HEADER_BYTES

MODEL = "bench/cold"


def key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, i * 1_000_003 - 7, "bfloat16")


def chunk(shape: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def settle(seconds: float) -> None:
    """Let the disk finish what earlier phases left it (dirty pages, its own flushing)."""
    os.sync()
    time.sleep(seconds)


def drop_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: Path, tensor: torch.Tensor) -> None:
    with open(path, "wb") as f:
        f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def pread_into(path: str, offset: int, out: torch.Tensor) -> None:
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise EOFError(path)
            done += n
    finally:
        os.close(fd)


# -- the child processes ---------------------------------------------------------------

_STORE_CHILD = """
import json, sys, time
import torch
from persisting.kv import ChunkKey, open_kv_store
root, model = sys.argv[1], sys.argv[2]
disk_bytes, n, profile = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
keys = [ChunkKey(model, 1, 0, i * 1_000_003 - 7, "bfloat16") for i in range(n)]
start = time.perf_counter()
store = open_kv_store(root, model, memory_bytes=0, disk_bytes=disk_bytes, durability="sync")
opened = time.perf_counter() - start
if profile:
    import cProfile, io, pstats
    prof = cProfile.Profile()
    prof.enable()
times = []
nbytes = 0
for k in keys:
    t0 = time.perf_counter()
    value = store.get(k)
    times.append(time.perf_counter() - t0)
    nbytes += value.numel() * value.element_size()
if profile:
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    print(text.getvalue(), file=sys.stderr)
store.close()
print(json.dumps({"open_s": opened, "get_s": times, "nbytes": nbytes}))
"""

_RAW_CHILD = """
import json, os, sys, time
import torch
paths, shape = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")]
times = []
nbytes = 0
for path in paths:
    t0 = time.perf_counter()
    out = torch.empty(shape, dtype=torch.bfloat16)
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    done = 0
    while done < len(view):
        done += os.preadv(fd, [view[done:]], done)
    os.close(fd)
    times.append(time.perf_counter() - t0)
    nbytes += done
print(json.dumps({"get_s": times, "nbytes": nbytes}))
"""


def run_child(code: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"child failed: {done.stderr[-2000:]}")
    if done.stderr.strip():
        print(done.stderr, file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the rows --------------------------------------------------------------------------


def bench(
    work: Path,
    chunks: int,
    shape: list[int],
    rounds: int,
    threads: int,
    settle_s: float,
    profile: bool,
) -> dict:
    values = [chunk(shape, i) for i in range(chunks)]
    nbytes = values[0].numel() * 2
    disk_bytes = 4 * chunks * nbytes + (64 << 20)
    store_root = work / "store"
    raw_dir = work / "raw"
    raw_dir.mkdir()
    with open_kv_store(
        store_root, MODEL, memory_bytes=0, disk_bytes=disk_bytes, durability="sync"
    ) as store:
        for i, v in enumerate(values):
            store.put(key(i), v)
            raw_write(raw_dir / f"{i}", v)
        locations = [store.lease(key(i), 0.0) for i in range(chunks)]
        store_files = [loc.path for loc in locations if loc is not None]
        assert len(store_files) == chunks
        got = store.batched_get([key(i) for i in range(chunks)])  # bit-exact, untimed
        assert all(torch.equal(g, v) for g, v in zip(got, values, strict=True))
    raw_files = [str(raw_dir / f"{i}") for i in range(chunks)]
    total = chunks * nbytes
    rows: dict[str, list[float]] = {k: [] for k in ("fresh_get", "fresh_raw", "open_s")}
    rows |= {"batched_get": [], "batched_raw": []}

    def fresh_store() -> None:
        settle(settle_s)
        drop_cache(store_files)
        out = run_child(_STORE_CHILD, str(store_root), MODEL, str(disk_bytes), str(chunks), "0")
        assert out["nbytes"] == total
        rows["fresh_get"].append(total / sum(out["get_s"]) / 1e9)
        rows["open_s"].append(out["open_s"])

    def fresh_raw() -> None:
        settle(settle_s)
        drop_cache(raw_files)
        out = run_child(_RAW_CHILD, ",".join(raw_files), ",".join(map(str, shape)))
        assert out["nbytes"] == total
        rows["fresh_raw"].append(total / sum(out["get_s"]) / 1e9)

    with open_kv_store(
        store_root,
        MODEL,
        memory_bytes=0,
        disk_bytes=disk_bytes,
        read_threads=threads,
        result_buffer_bytes=0,
    ) as reader:
        keys = [key(i) for i in range(chunks)]

        def batched_store() -> None:
            settle(settle_s)
            drop_cache(store_files)
            start = time.perf_counter()
            got = reader.batched_get(keys)
            rows["batched_get"].append(total / (time.perf_counter() - start) / 1e9)
            assert all(g is not None for g in got)

        def batched_raw() -> None:
            settle(settle_s)
            drop_cache(store_files)
            start = time.perf_counter()
            outs = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(chunks)]
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(pread_into, store_files, [HEADER_BYTES] * chunks, outs))
            rows["batched_raw"].append(total / (time.perf_counter() - start) / 1e9)

        for r in range(rounds):
            pairs = [(fresh_store, fresh_raw), (batched_store, batched_raw)]
            for first, second in pairs:
                if r % 2:
                    first, second = second, first
                first()
                second()
    if profile:
        settle(settle_s)
        drop_cache(store_files)
        run_child(_STORE_CHILD, str(store_root), MODEL, str(disk_bytes), str(chunks), "1")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "chunks": chunks,
        "chunk_mib": nbytes / (1 << 20),
        "threads": threads,
        "rounds": rounds,
        "fresh_process_get_gbps": round(med["fresh_get"], 3),
        "fresh_process_raw_gbps": round(med["fresh_raw"], 3),
        "fresh_process_ratio": round(med["fresh_get"] / med["fresh_raw"], 3),
        "fresh_process_open_s": round(med["open_s"], 4),
        "batched_get_gbps": round(med["batched_get"], 3),
        "batched_raw_gbps": round(med["batched_raw"], 3),
        "batched_ratio": round(med["batched_get"] / med["batched_raw"], 3),
        "all_rounds": {k: [round(x, 3) for x in v] for k, v in rows.items()},
    }


def summary(row: dict) -> str:
    return (
        f"cold get, fresh process ({row['chunks']} x {row['chunk_mib']:.0f} MiB): "
        f"{row['fresh_process_get_gbps']:.2f} GB/s vs raw read {row['fresh_process_raw_gbps']:.2f}"
        f" -> {row['fresh_process_ratio']:.2f}x (store open {row['fresh_process_open_s']:.3f} s)"
        f" | cold batched get: {row['batched_get_gbps']:.2f} GB/s vs raw {row['threads']}-thread"
        f" preadv {row['batched_raw_gbps']:.2f} -> {row['batched_ratio']:.2f}x"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--shape", type=int, nargs=4, default=[2, 16, 256, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--profile", action="store_true")


def run(args: argparse.Namespace, directory: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        return bench(
            Path(tmp),
            args.chunks,
            args.shape,
            args.rounds,
            args.threads,
            args.settle_s,
            args.profile,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    row = run(args, args.dir)
    print(summary(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    json.dump(row, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
