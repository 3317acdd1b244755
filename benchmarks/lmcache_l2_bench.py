"""LMCache multiprocess-mode L2 adapters: PersistingL2Adapter vs LMCache's own ``fs``.

Each adapter is built by LMCache's own config parsing and factory from its ``--l2-adapter``
JSON and driven through ``L2AdapterInterface`` as LMCache's controllers drive it: tasks
submitted, completion observed on the event fds. Per round, each adapter gets a fresh
directory and the same ``--chunks`` objects (``TensorMemoryObj`` s of ``--shape``), and
the round goes phase by phase, the adapters back to back within each phase:

* store: every chunk, ``--batch`` keys per store task, all tasks in flight at once, timed
  until the last task completes;
* lookup: lookup-and-lock of every key (one task per batch), timed; then unlocked;
* load: every chunk into zeroed destination objects (zeroed before the settle; one task
  per batch), timed, then each compared byte for byte with what was stored (a miss or a
  wrong byte is an integrity error);
* restart: the adapter is closed and a new one opened on the same directory; it reports
  how many chunks a lookup finds and the usage it starts with (LMCache's ``fs`` adapter
  finds its files again but starts from zero usage: its capacity accounting and eviction
  order are gone).

The disk is settled (``os.sync()`` and a pause) before every timed phase, the adapters
take turns going first (rotated each round, so use a multiple of their number as
``--rounds``), rates are medians over rounds, and each ratio (Persisting / fs, > 1:
Persisting is faster) is the median of the per-round ratios, both sides of which ran
seconds apart. ``fs_native`` (LMCache's C++ connector) runs too when this LMCache build
has it.

Persisting runs with ``fsync: false`` by default, like ``fs`` (neither waits for the disk:
both survive a crash of the process, not of the machine); ``--fsync`` also measures it
with ``fsync: true``.

    .venv/bin/python benchmarks/lmcache_l2_bench.py --fsync          # 64 chunks of 4 MiB
    .venv/bin/python benchmarks/lmcache_l2_bench.py --chunks 8 --shape 2,4,16,256 \\
        --rounds 1 --settle 0                                        # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

MODEL = "meta-llama/Llama-3-8B"
DTYPE = torch.bfloat16
LAYOUTS = {0: MemoryLayoutDesc(shapes=[], dtypes=[])}


def adapter_entry(name: str, directory: Path, capacity: int) -> dict[str, Any]:
    if name == "fs":
        return {"type": "fs", "base_path": str(directory)}
    if name == "fs_native":
        return {"type": "fs_native", "base_path": str(directory)}
    return {
        "type": "plugin",
        "module_path": "persisting.lmcache",
        "class_name": "PersistingL2Adapter",
        "adapter_params": {
            "storage_path": str(directory),
            "capacity": capacity,
            "fsync": name == "persisting-fsync",
        },
    }


def make_adapter(name: str, directory: Path, capacity: int) -> L2AdapterInterface:
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    entry = adapter_entry(name, directory, capacity)
    args = parser.parse_args(["--l2-adapter", json.dumps(entry)])
    (config,) = parse_args_to_l2_adapters_config(args).adapters
    return create_l2_adapter_from_registry(config)


def make_objects(n: int, shape: torch.Size, seed: int | None) -> list[TensorMemoryObj]:
    nbytes = int(shape.numel()) * DTYPE.itemsize
    gen = torch.Generator().manual_seed(seed or 0)
    out = []
    for _ in range(n):
        if seed is None:
            raw = torch.zeros(nbytes, dtype=torch.uint8)
        else:
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        meta = MemoryObjMetadata(
            shape=shape,
            dtype=DTYPE,
            address=0,
            phy_size=nbytes,
            fmt=MemoryFormat.KV_2LTD,
            ref_count=1,
        )
        out.append(TensorMemoryObj(raw, meta, parent_allocator=None))
    return out


def make_keys(n: int, round_no: int) -> list[ObjectKey]:
    return [
        ObjectKey(
            chunk_hash=((round_no << 32 | i) * 0x9E3779B97F4A7C15 % (1 << 64)).to_bytes(8, "big"),
            model_name=MODEL,
            kv_rank=0,
        )
        for i in range(n)
    ]


def _drain(fd: int, timeout_s: float) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if poll.poll(timeout_s * 1000):
        with suppress(BlockingIOError):
            consume_fd(fd)


def _wait_all(fd: int, pending: set[int], collect: Callable[[], dict[int, Any]]) -> dict:
    """Wait on ``fd`` until every task in ``pending`` has a result; returns the results."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + 600
    while pending - set(results):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending - set(results))} tasks did not complete")
        results.update(collect())
        if pending - set(results):
            _drain(fd, 1.0)
    return results


def _batches(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def timed_store(adapter: L2AdapterInterface, keys: list, objs: list, batch: int) -> tuple:
    start = time.perf_counter()
    tasks = {
        adapter.submit_store_task(keys[lo:hi], objs[lo:hi]) for lo, hi in _batches(len(keys), batch)
    }
    results = _wait_all(adapter.get_store_event_fd(), tasks, adapter.pop_completed_store_tasks)
    elapsed = time.perf_counter() - start
    failed = sum(1 for task in tasks if not results[task].is_successful())
    return elapsed, failed


def _query_all(adapter_fd: int, query: Callable[[int], Any], tasks: list[int]) -> dict:
    def collect() -> dict[int, Any]:
        return {t: r for t in tasks if (r := query(t)) is not None}

    return _wait_all(adapter_fd, set(tasks), collect)


def timed_lookup(adapter: L2AdapterInterface, keys: list, batch: int) -> tuple[float, int]:
    start = time.perf_counter()
    spans = _batches(len(keys), batch)
    tasks = [adapter.submit_lookup_and_lock_task(keys[lo:hi], LAYOUTS) for lo, hi in spans]
    results = _query_all(
        adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, tasks
    )
    elapsed = time.perf_counter() - start
    found = sum(len(results[t].get_indices_list()) for t in tasks)
    adapter.submit_unlock(keys)
    return elapsed, found


def clear(dest: list[TensorMemoryObj]) -> None:
    """Zero the destinations before a load (done before the settle: torch's zeroing leaves
    its OpenMP threads spinning for a while, which would take a core from the timed load)."""
    for obj in dest:
        obj.raw_data.zero_()


def timed_load(adapter: L2AdapterInterface, keys: list, dest: list, batch: int) -> tuple:
    start = time.perf_counter()
    spans = _batches(len(keys), batch)
    tasks = [adapter.submit_load_task(keys[lo:hi], dest[lo:hi]) for lo, hi in spans]
    results = _query_all(adapter.get_load_event_fd(), adapter.query_load_result, tasks)
    elapsed = time.perf_counter() - start
    loaded = sum(len(results[t].get_indices_list()) for t in tasks)
    return elapsed, loaded


def integrity_errors(objs: list[TensorMemoryObj], dest: list[TensorMemoryObj]) -> int:
    return sum(
        1 for a, b in zip(objs, dest, strict=True) if not torch.equal(a.raw_data, b.raw_data)
    )


def settle(seconds: float) -> None:
    os.sync()
    time.sleep(seconds)


def run_round(names: list[str], args: argparse.Namespace, base: Path, round_no: int, data: dict):
    """One round: every adapter on a fresh directory, phase by phase. Within each phase the
    adapters run back to back (in ``names`` order, rotated by the caller each round), each
    after the disk has settled, so both sides of a ratio see the same machine."""
    keys, objs, dest = make_keys(len(data["objs"]), round_no), data["objs"], data["dest"]
    nbytes = sum(o.get_size() for o in objs)
    capacity = 4 * nbytes + (64 << 20)
    dirs = {name: base / f"{name}-{round_no}" for name in names}
    out = {name: {"adapter": name, "round": round_no} for name in names}
    adapters = {name: make_adapter(name, dirs[name], capacity) for name in names}
    try:
        for name in names:
            settle(args.settle)
            store_s, failed_tasks = timed_store(adapters[name], keys, objs, args.batch)
            out[name].update(store_gbps=nbytes / store_s / 1e9, failed_store_tasks=failed_tasks)
        for name in names:
            settle(args.settle)
            lookup_s, found = timed_lookup(adapters[name], keys, args.batch)
            out[name].update(lookup_keys_per_s=len(keys) / lookup_s, found=found)
        for name in names:
            clear(dest)
            settle(args.settle)
            load_s, loaded = timed_load(adapters[name], keys, dest, args.batch)
            errors = integrity_errors(objs, dest) + (len(keys) - loaded)
            out[name].update(load_gbps=nbytes / load_s / 1e9, integrity_errors=errors)
    finally:
        for adapter in adapters.values():
            adapter.close()
    for name in names:
        reopened = make_adapter(name, dirs[name], capacity)
        try:
            _, found_after = timed_lookup(reopened, keys, args.batch)
            usage_after = reopened.get_usage().total_bytes_used
        finally:
            reopened.close()
        shutil.rmtree(dirs[name], ignore_errors=True)
        out[name].update(found_after_restart=found_after, usage_after_restart=usage_after)
    return [out[name] for name in names]


def available(name: str, base: Path) -> str | None:
    """None if the adapter can be built here, else why not."""
    try:
        make_adapter(name, base / f"probe-{name}", 1 << 30).close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(base / f"probe-{name}", ignore_errors=True)
    return None


def summary(results: list[dict], name: str) -> dict[str, float]:
    mine = [r for r in results if r["adapter"] == name]
    out = {k: statistics.median(r[k] for r in mine) for k in RATES}
    for k in ("integrity_errors", "failed_store_tasks"):
        out[k] = sum(r[k] for r in mine)
    out["found_after_restart"] = min(r["found_after_restart"] for r in mine)
    out["usage_after_restart"] = min(r["usage_after_restart"] for r in mine)
    return out


RATES = ("store_gbps", "lookup_keys_per_s", "load_gbps")


def round_ratios(results: list[dict], name: str) -> dict[str, float]:
    """Median over rounds of ``name``'s rate / fs's rate in the same round: a ratio of two
    runs minutes apart would measure the machine's drift as much as the adapters."""
    fs = {r["round"]: r for r in results if r["adapter"] == "fs"}
    mine = [r for r in results if r["adapter"] == name]
    return {k: statistics.median(r[k] / fs[r["round"]][k] for r in mine) for k in RATES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=64, help="objects per round")
    parser.add_argument("--shape", default="2,8,256,512", help="object shape (bfloat16)")
    parser.add_argument("--batch", type=int, default=8, help="keys per task")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--settle", type=float, default=5.0, help="pause after os.sync()")
    parser.add_argument("--fsync", action="store_true", help="also Persisting with fsync")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    shape = torch.Size(int(x) for x in args.shape.split(","))
    base = Path(tempfile.mkdtemp(prefix="l2bench-", dir=args.dir))
    names = ["fs", "persisting"] + (["persisting-fsync"] if args.fsync else [])
    why = available("fs_native", base)
    if why is None:
        names.insert(1, "fs_native")
    else:
        print(f"fs_native: not run ({why.splitlines()[0][:120]})")
    data = {
        "objs": make_objects(args.chunks, shape, seed=1),
        "dest": make_objects(args.chunks, shape, None),
    }
    mib = args.chunks * shape.numel() * DTYPE.itemsize / 2**20
    print(
        f"{args.chunks} chunks of {list(shape)} bf16 ({mib:.0f} MiB per round), batch {args.batch}"
    )
    results: list[dict] = []
    try:
        for round_no in range(args.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for result in run_round(order, args, base, round_no, data):
                results.append(result)
                name = result["adapter"]
                print(
                    f"round {round_no} {name:>16}: store {result['store_gbps']:.2f} GB/s, "
                    f"lookup {result['lookup_keys_per_s']:,.0f} keys/s, "
                    f"load {result['load_gbps']:.2f} GB/s, errors {result['integrity_errors']}, "
                    f"after restart {result['found_after_restart']}/{args.chunks} found, "
                    f"usage {result['usage_after_restart']:,} B"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    table = {name: summary(results, name) for name in names}
    print()
    print(
        f"{'adapter':>16} {'store GB/s':>11} {'lookup k/s':>11} {'load GB/s':>10} "
        f"{'errors':>7} {'found after restart':>20} {'usage after restart':>20}"
    )
    for name, row in table.items():
        print(
            f"{name:>16} {row['store_gbps']:>11.2f} {row['lookup_keys_per_s'] / 1e3:>11.1f} "
            f"{row['load_gbps']:>10.2f} {row['integrity_errors']:>7} "
            f"{row['found_after_restart']:>14}/{args.chunks:<5} {row['usage_after_restart']:>20,}"
        )
    for name in names:
        if name != "fs":
            ratio = round_ratios(results, name)
            print(
                f"{name} / fs (median of per-round ratios): "
                f"store {ratio['store_gbps']:.2f}x, lookup {ratio['lookup_keys_per_s']:.2f}x, "
                f"load {ratio['load_gbps']:.2f}x"
            )
    if args.json is not None:
        ratios = {name: round_ratios(results, name) for name in names if name != "fs"}
        args.json.write_text(
            json.dumps({"runs": results, "summary": table, "ratios": ratios}, indent=2)
        )
    ours = [row for name, row in table.items() if name.startswith("persisting")]
    broken = any(row["integrity_errors"] for row in table.values()) or any(
        row["found_after_restart"] != args.chunks for row in ours
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
