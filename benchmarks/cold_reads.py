"""Cold reads from disk against raw reads of the same bytes, measured as an independent
check would (issues 12, 17 and 27).

    .venv/bin/python benchmarks/cold_reads.py [--chunks 16] [--batch 24]
        [--shape 2 16 256 512] [--rounds 5] [--threads 8] [--settle-s 5] [--profile]
        [--json out.json]

Four rows, each a median of ``--rounds`` alternating rounds (the side that goes first
alternates). Before every timed phase the disk is let settle (``os.sync()`` and a pause of
``--settle-s``: the virtual disks here keep flushing long after fsync returns and slow
whatever comes next 3-4x) and the page cache of that side's files is dropped
(``posix_fadvise(DONTNEED)``).

- ``fresh_process`` (results dropped): ``--chunks`` chunks of ``[2, 16, 256, 512]`` bf16
  (8 MiB) put with ``store.put`` into a store with ``memory_bytes=0, durability="sync"``;
  the raw side writes each chunk's bytes to a file of its own (buffered write, flush,
  fsync). A NEW PROCESS then opens the store and gets each key once, dropping each value
  before the next get (so each lands in the pages the previous one left), against a new
  process reading each raw file into a freshly allocated tensor it drops likewise. Times
  are of the gets and the reads (torch is imported and the store opened before the clock
  starts; the open is reported apart).
- ``fresh_process_kept``: the same, every result kept in a list on both sides, so each
  value lands in pages nobody touched yet (what an engine restoring a prefix into a list
  does, and the independent check of issue 27).
- ``batched``: one ``store.batched_get`` of ``--batch`` chunks (``read_threads =
  --threads``, fresh result buffers: ``result_buffer_bytes=0``) in this process, against a
  raw ``preadv`` of the store's own payload files into fresh tensors on a pool of the same
  number of threads.
- ``batched_fresh_process``: one ``batched_get`` of the ``--batch`` chunks in a NEW
  PROCESS with the store's default settings (its result pages), every result kept,
  against a new process reading the same files with ``preadv`` into fresh tensors on
  ``--threads`` threads.

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
from persisting.kv.disk.payload_files import HEADER_BYTES

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
how = sys.argv[6]  # dropped, kept or batched
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
kept = []
if how == "batched":
    t0 = time.perf_counter()
    kept = store.batched_get(keys)
    times.append(time.perf_counter() - t0)
    nbytes = sum(v.numel() * v.element_size() for v in kept)
for k in keys if how != "batched" else ():
    t0 = time.perf_counter()
    value = store.get(k)
    times.append(time.perf_counter() - t0)
    nbytes += value.numel() * value.element_size()
    if how == "kept":
        kept.append(value)
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
from concurrent.futures import ThreadPoolExecutor
import torch
paths, shape = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")]
how, offset, threads = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
def read(path, out):
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    done = 0
    while done < len(view):
        done += os.preadv(fd, [view[done:]], offset + done)
    os.close(fd)
    return done
times = []
nbytes = 0
kept = []
if how == "batched":
    t0 = time.perf_counter()
    kept = [torch.empty(shape, dtype=torch.bfloat16) for _ in paths]
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(read, paths, kept))
    times.append(time.perf_counter() - t0)
for path in paths if how != "batched" else ():
    t0 = time.perf_counter()
    out = torch.empty(shape, dtype=torch.bfloat16)
    nbytes += read(path, out)
    times.append(time.perf_counter() - t0)
    if how == "kept":
        kept.append(out)
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
    batch: int | None = None,
) -> dict:
    batch = batch or chunks
    written = max(chunks, batch)
    values = [chunk(shape, i) for i in range(written)]
    nbytes = values[0].numel() * 2
    disk_bytes = 4 * written * nbytes + (64 << 20)
    store_root = work / "store"
    raw_dir = work / "raw"
    raw_dir.mkdir()
    with open_kv_store(
        store_root, MODEL, memory_bytes=0, disk_bytes=disk_bytes, durability="sync"
    ) as store:
        for i, v in enumerate(values):
            store.put(key(i), v)
            if i < chunks:
                raw_write(raw_dir / f"{i}", v)
        locations = [store.lease(key(i), 0.0) for i in range(written)]
        all_files = [loc.path for loc in locations if loc is not None]
        assert len(all_files) == written
        got = store.batched_get([key(i) for i in range(written)])  # bit-exact, untimed
        assert all(torch.equal(g, v) for g, v in zip(got, values, strict=True))
        del got
    store_files, batch_files = all_files[:chunks], all_files[:batch]
    raw_files = [str(raw_dir / f"{i}") for i in range(chunks)]
    total, batch_total = chunks * nbytes, batch * nbytes
    names = ("fresh_get", "fresh_raw", "open_s", "kept_get", "kept_raw")
    rows: dict[str, list[float]] = {k: [] for k in names}
    rows |= {k: [] for k in ("batched_get", "batched_raw", "fresh_batched_get")}
    rows["fresh_batched_raw"] = []
    shape_arg = ",".join(map(str, shape))

    def store_child(how: str, n: int, files: list[str], row: str, size: int) -> None:
        settle(settle_s)
        drop_cache(files)
        out = run_child(_STORE_CHILD, str(store_root), MODEL, str(disk_bytes), str(n), "0", how)
        assert out["nbytes"] == size
        rows[row].append(size / sum(out["get_s"]) / 1e9)
        if how == "dropped":
            rows["open_s"].append(out["open_s"])

    def raw_child(how: str, files: list[str], offset: int, row: str, size: int) -> None:
        settle(settle_s)
        drop_cache(files)
        out = run_child(_RAW_CHILD, ",".join(files), shape_arg, how, str(offset), str(threads))
        assert out["nbytes"] == size
        rows[row].append(size / sum(out["get_s"]) / 1e9)

    with open_kv_store(
        store_root,
        MODEL,
        memory_bytes=0,
        disk_bytes=disk_bytes,
        read_threads=threads,
        result_buffer_bytes=0,
    ) as reader:
        keys = [key(i) for i in range(batch)]

        def batched_store() -> None:
            settle(settle_s)
            drop_cache(batch_files)
            start = time.perf_counter()
            got = reader.batched_get(keys)
            rows["batched_get"].append(batch_total / (time.perf_counter() - start) / 1e9)
            assert all(g is not None for g in got)

        def batched_raw() -> None:
            settle(settle_s)
            drop_cache(batch_files)
            start = time.perf_counter()
            outs = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(batch)]
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(pread_into, batch_files, [HEADER_BYTES] * batch, outs))
            rows["batched_raw"].append(batch_total / (time.perf_counter() - start) / 1e9)

        pairs = [
            (
                lambda: store_child("dropped", chunks, store_files, "fresh_get", total),
                lambda: raw_child("dropped", raw_files, 0, "fresh_raw", total),
            ),
            (
                lambda: store_child("kept", chunks, store_files, "kept_get", total),
                lambda: raw_child("kept", raw_files, 0, "kept_raw", total),
            ),
            (batched_store, batched_raw),
            (
                lambda: store_child(
                    "batched", batch, batch_files, "fresh_batched_get", batch_total
                ),
                lambda: raw_child(
                    "batched", batch_files, HEADER_BYTES, "fresh_batched_raw", batch_total
                ),
            ),
        ]
        for r in range(rounds):
            for first, second in pairs:
                if r % 2:
                    first, second = second, first
                first()
                second()
    if profile:
        settle(settle_s)
        drop_cache(store_files)
        run_child(_STORE_CHILD, str(store_root), MODEL, str(disk_bytes), str(chunks), "1", "kept")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "chunks": chunks,
        "batch": batch,
        "chunk_mib": nbytes / (1 << 20),
        "threads": threads,
        "rounds": rounds,
        "load_average": round(os.getloadavg()[0], 2),
        "fresh_process_get_gbps": round(med["fresh_get"], 3),
        "fresh_process_raw_gbps": round(med["fresh_raw"], 3),
        "fresh_process_ratio": round(med["fresh_get"] / med["fresh_raw"], 3),
        "fresh_process_open_s": round(med["open_s"], 4),
        "kept_get_gbps": round(med["kept_get"], 3),
        "kept_raw_gbps": round(med["kept_raw"], 3),
        "kept_ratio": round(med["kept_get"] / med["kept_raw"], 3),
        "batched_get_gbps": round(med["batched_get"], 3),
        "batched_raw_gbps": round(med["batched_raw"], 3),
        "batched_ratio": round(med["batched_get"] / med["batched_raw"], 3),
        "fresh_batched_get_gbps": round(med["fresh_batched_get"], 3),
        "fresh_batched_raw_gbps": round(med["fresh_batched_raw"], 3),
        "fresh_batched_ratio": round(med["fresh_batched_get"] / med["fresh_batched_raw"], 3),
        "all_rounds": {k: [round(x, 3) for x in v] for k, v in rows.items()},
    }


def summary(row: dict) -> str:
    threads = row["threads"]
    return "\n".join(
        [
            f"cold get, fresh process ({row['chunks']} x {row['chunk_mib']:.0f} MiB), results"
            f" dropped: {row['fresh_process_get_gbps']:.2f} GB/s vs raw read "
            f"{row['fresh_process_raw_gbps']:.2f} -> {row['fresh_process_ratio']:.2f}x "
            f"(store open {row['fresh_process_open_s']:.3f} s)",
            f"cold get, fresh process, results kept: {row['kept_get_gbps']:.2f} GB/s vs raw "
            f"read {row['kept_raw_gbps']:.2f} -> {row['kept_ratio']:.2f}x",
            f"cold batched get of {row['batch']} (result_buffer_bytes=0): "
            f"{row['batched_get_gbps']:.2f} GB/s vs raw {threads}-thread preadv "
            f"{row['batched_raw_gbps']:.2f} -> {row['batched_ratio']:.2f}x",
            f"cold batched get of {row['batch']}, fresh process, results kept: "
            f"{row['fresh_batched_get_gbps']:.2f} GB/s vs raw {threads}-thread preadv "
            f"{row['fresh_batched_raw_gbps']:.2f} -> {row['fresh_batched_ratio']:.2f}x "
            f"(load average {row['load_average']})",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=24, help="values per batched get")
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
            args.batch,
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
