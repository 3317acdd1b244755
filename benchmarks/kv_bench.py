"""KV store throughput against raw baselines measured in the same run.

    .venv/bin/python benchmarks/kv_bench.py [--sizes-mib 4 8 32] [--count 16] [--json out.json]

For each chunk size it measures, alternating store and baseline rounds:

- durable put (``durability="sync"``)  vs  plain file write + fsync of the same bytes
- async put (write-behind ack)          vs  the same plain write + fsync
- cold get from disk                    vs  plain read into a freshly allocated tensor
  (page cache dropped with ``posix_fadvise(DONTNEED)`` for store files and baseline alike),
  each result dropped before the next read (``cold_get``: the store reuses its result
  pages), and every result kept (``cold_get_kept``: each lands in pages nobody touched yet,
  on both sides)
- warm get from memory                  vs  one memcpy into a freshly allocated tensor,
  results dropped (``warm_get``) and kept (``warm_get_kept``)

and ``lookup_prefix`` of a 512-chunk prefix over an index of 10k and 1M keys against a
plain dict membership test, plus the index's memory per key; then the two cold-read rows of
``cold_reads.py`` (a get of each key in a fresh process vs a raw read into a fresh tensor,
and a cold ``batched_get`` vs a raw multi-threaded ``preadv`` of the same files; see there).
Ratios > 1 mean faster than the baseline. Figures are medians of several rounds (these
machines are shared and noisy). Before each timed phase the disk is let settle (``os.sync()``
and ``--settle-s``), and store and baseline alternate going first: a disk still flushing
what the previous phase wrote slows the next one 3-4x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cold_reads

from persisting.kv import ChunkKey, Layout, open_kv_store
from persisting.kv.index import DiskEntry

MiB = 1 << 20
MODEL = "bench/model"


def chunk(nbytes: int, seed: int) -> torch.Tensor:
    hidden = 1024
    tokens = nbytes // (2 * 8 * hidden * 2)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, tokens, hidden, generator=g).to(torch.bfloat16)


def key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, i * 1_000_003 - 7, "bfloat16")


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def baseline_write(path: Path, t: torch.Tensor) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, t.view(-1).view(torch.uint8).numpy())
        os.fsync(fd)
    finally:
        os.close(fd)


def baseline_read(path: Path, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            done += os.preadv(fd, [view[done:]], done)
    finally:
        os.close(fd)
    return out


def timed(fn, *args):
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def bench_size(workdir: Path, size_mib: int, count: int, settle_s: float = 5.0) -> dict[str, float]:
    nbytes = size_mib * MiB
    values = [chunk(nbytes, i) for i in range(count)]
    base_dir = workdir / f"baseline-{size_mib}"
    base_dir.mkdir()
    gbps = lambda secs: nbytes / secs / 1e9  # noqa: E731
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "put_sync",
            "put_base",
            "put_async",
            "cold_get",
            "cold_base",
            "cold_get_kept",
            "cold_base_kept",
            "warm_get",
            "memcpy",
            "warm_get_kept",
            "memcpy_kept",
        )
    }
    store_root = workdir / f"store-{size_mib}"
    with (
        open_kv_store(
            store_root, MODEL, memory_bytes=0, disk_bytes=4 * count * nbytes, durability="sync"
        ) as sync_store,
        open_kv_store(
            workdir / f"async-{size_mib}",
            MODEL,
            memory_bytes=2 * count * nbytes,
            disk_bytes=4 * count * nbytes,
            durability="async",
        ) as async_store,
    ):
        for i, v in enumerate(values):
            cold_reads.settle(settle_s / 4)
            put_base = lambda i=i, v=v: rows["put_base"].append(  # noqa: E731
                gbps(timed(baseline_write, base_dir / f"{i}", v)[0])
            )
            put_sync = lambda i=i, v=v: rows["put_sync"].append(  # noqa: E731
                gbps(timed(sync_store.put, key(i), v)[0])
            )
            for phase in (put_base, put_sync) if i % 2 == 0 else (put_sync, put_base):
                phase()
            rows["put_async"].append(gbps(timed(async_store.put, key(i), v)[0]))
            async_store.flush()  # untimed: its write-behind must not slow the next rounds
        for kept in (False, True):
            cold_reads.settle(settle_s)
            suffix = "_kept" if kept else ""
            got_list: list[torch.Tensor] = []  # what a caller keeps (kept rows)
            base_list: list[torch.Tensor] = []
            for i, v in enumerate(values):
                loc = sync_store.lease(key(i), 0.0)
                assert loc is not None
                drop_cache(loc.path)
                drop_cache(str(base_dir / f"{i}"))
                if i % 2:
                    secs, out = timed(baseline_read, base_dir / f"{i}", v)
                    rows[f"cold_base{suffix}"].append(gbps(secs))
                    if kept:
                        base_list.append(out)
                secs, got = timed(sync_store.get, key(i))
                rows[f"cold_get{suffix}"].append(gbps(secs))
                assert torch.equal(got, v)
                if kept:
                    got_list.append(got)
                del got
                if i % 2 == 0:
                    secs, out = timed(baseline_read, base_dir / f"{i}", v)
                    rows[f"cold_base{suffix}"].append(gbps(secs))
                    if kept:
                        base_list.append(out)
            del got_list, base_list
        for kept in (False, True):
            suffix = "_kept" if kept else ""
            held: list[torch.Tensor] = []
            for i, v in enumerate(values):
                secs, copy = timed(lambda src: torch.empty_like(src).copy_(src), v)
                rows[f"memcpy{suffix}"].append(gbps(secs))
                secs, got = timed(async_store.get, key(i))
                rows[f"warm_get{suffix}"].append(gbps(secs))
                assert torch.equal(got, v)
                if kept:
                    held += [copy, got]
                del got, copy
            del held
        assert async_store.stats().get("get_hit_memory", 0) == 2 * count
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "size_mib": size_mib,
        **{f"{k}_gbps": round(v, 3) for k, v in med.items()},
        "durable_put_ratio": round(med["put_sync"] / med["put_base"], 3),
        "async_put_ratio": round(med["put_async"] / med["put_base"], 3),
        "cold_get_ratio": round(med["cold_get"] / med["cold_base"], 3),
        "cold_get_kept_ratio": round(med["cold_get_kept"] / med["cold_base_kept"], 3),
        "warm_get_ratio": round(med["warm_get"] / med["memcpy"], 3),
        "warm_get_kept_ratio": round(med["warm_get_kept"] / med["memcpy_kept"], 3),
    }


def bench_lookup(
    workdir: Path, n_keys: int, prefix: int = 512, reps: int = 200
) -> dict[str, float]:
    """lookup_prefix over an index of ``n_keys`` (entries added directly: no payload files)."""
    with open_kv_store(
        workdir / f"lookup-{n_keys}", MODEL, memory_bytes=MiB, disk_bytes=1 << 40
    ) as store:
        # White-box: the disk tier's index filled directly (no payload files), so the
        # index is as large as asked in seconds; the store keeps its tiers private.
        disk = store._tiers.disk
        assert disk is not None
        layout = Layout((2, 8, 256, 1024), "bfloat16", "KV_2LTD", 8 * MiB)
        keys = [str(key(i)) for i in range(n_keys)]
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i, k in enumerate(keys):
            disk.index.add(k, DiskEntry(layout, i, keys[i - 1] if i else None, i))
        per_key = (tracemalloc.get_traced_memory()[0] - before) / n_keys
        tracemalloc.stop()
        probe = keys[n_keys - prefix :]
        plain = dict.fromkeys(keys)
        assert store.lookup_prefix(probe) == prefix
        store_s = min(timed(store.lookup_prefix, probe)[0] for _ in range(reps))
        base_s = min(timed(lambda p: all(k in plain for k in p), probe)[0] for _ in range(reps))
        disk.index = type(disk.index)()  # nothing to write back on close
        return {
            "index_keys": n_keys,
            "prefix_chunks": prefix,
            "lookup_us": round(store_s * 1e6, 1),
            "lookup_us_per_key": round(store_s * 1e6 / prefix, 3),
            "dict_us": round(base_s * 1e6, 1),
            "lookup_vs_dict_ratio": round(base_s / store_s, 3),
            "index_bytes_per_key": round(per_key, 1),
            "key_chars": len(keys[0]),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 8, 32])
    parser.add_argument("--count", type=int, default=16, help="chunks per size")
    parser.add_argument("--index-sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--skip-cold", action="store_true", help="leave out cold_reads' rows")
    cold_reads.add_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        results: dict = {"sizes": [], "lookup": [], "load_average": os.getloadavg()[0]}
        for size in args.sizes_mib:
            row = bench_size(work, size, args.count, args.settle_s)
            results["sizes"].append(row)
            print(
                f"{size:>3} MiB  durable put {row['put_sync_gbps']:.2f} GB/s vs write+fsync "
                f"{row['put_base_gbps']:.2f} -> {row['durable_put_ratio']:.2f}x | async put "
                f"{row['async_put_ratio']:.2f}x | cold get {row['cold_get_gbps']:.2f} vs read "
                f"{row['cold_base_gbps']:.2f} -> {row['cold_get_ratio']:.2f}x | cold get kept "
                f"{row['cold_get_kept_gbps']:.2f} vs read kept {row['cold_base_kept_gbps']:.2f}"
                f" -> {row['cold_get_kept_ratio']:.2f}x | warm get "
                f"{row['warm_get_gbps']:.2f} vs memcpy {row['memcpy_gbps']:.2f} -> "
                f"{row['warm_get_ratio']:.2f}x | warm get kept {row['warm_get_kept_gbps']:.2f} "
                f"vs memcpy kept {row['memcpy_kept_gbps']:.2f} -> "
                f"{row['warm_get_kept_ratio']:.2f}x",
                flush=True,
            )
        for n in args.index_sizes:
            row = bench_lookup(work, n)
            results["lookup"].append(row)
            print(
                f"lookup_prefix of {row['prefix_chunks']} keys in a {n}-key index: "
                f"{row['lookup_us']:.0f} us ({row['lookup_us_per_key']:.2f} us/key) vs dict "
                f"{row['dict_us']:.0f} us -> {row['lookup_vs_dict_ratio']:.2f}x; index "
                f"{row['index_bytes_per_key']:.0f} B/key",
                flush=True,
            )
        if not args.skip_cold:
            results["cold"] = cold_reads.run(args, work)
            print(cold_reads.summary(results["cold"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
