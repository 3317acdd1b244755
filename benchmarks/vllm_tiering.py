"""vLLM's tiered offloading on a CPU host, driven by a JSON plan: the side that runs in the
engine environment for the ``PersistingTier`` tests and ``benchmarks/vllm_tier_bench.py``.

    .venv-vllm/bin/python benchmarks/vllm_tiering.py PLAN.json OUT.json

It builds vLLM's own ``TieringOffloadingSpec`` from an ``OffloadingConfig`` and takes its
manager (``get_manager()``: a ``TieringOffloadingManager`` over a
``CPUPrimaryTierOffloadingManager`` whose rows are a ``SharedOffloadRegion`` under
``/dev/shm``, and the plan's ``secondary_tiers``, made by vLLM's ``SecondaryTierFactory``).
No CUDA call is made: the GPU side of vLLM's offloading (its worker) is the one part not
run; a plan writes a chunk's bytes into its row where vLLM's GPU->CPU copy would, and
reads a promoted row where vLLM's CPU->GPU copy would. The plan::

    {"engine_id": "t1", "row_kib": 256, "world_size": 2, "chunks": 64, "events": true,
     "tiers": [{"type": "PersistingTier", "module_path": "persisting.integrations.vllm",
                "storage_path": "/r", ...}],
     "steps": [...]}

``row_kib`` is one rank's slot of a row (a row holds ``world_size`` of them, each filled
with its own bytes); ``chunks`` is the CPU tier's size in rows. Steps (each records what
it saw in the output, written after every step):

- ``{"action": "store", "seed": 1, "count": 16, "jobs": 2}``: chunks ``seed:0..count-1``
  stored into the CPU tier as ``jobs`` requests (with ``"one_request": true``, as ``jobs``
  steps of one request: a prompt's chunks in order) and cascaded to the tiers; waits for
  every cascade; records the seconds from the first cascade to the last one finished (with
  ``"sync": true`` also ``synced_seconds``: until ``os.sync()`` returned after that, the
  bytes on the disk) and ``cpu_seconds``: the CPU this process used meanwhile (user and
  system, every thread: vLLM's, the tiers' and their background work alike);
- ``{"action": "promote", "seed": 1, "count": 16, "jobs": 2}``: looks the chunks up (new
  requests) until each is a hit in the CPU tier (promoted) or a miss; records which, the
  seconds, ``cpu_seconds`` (as a store's), and whether every hit's row holds exactly the
  bytes stored;
- ``{"action": "lookup", "seed": 1, "count": 16}``: one lookup per chunk, a fresh request
  (no promotion waited for): ``MISS``/``HIT``/``HIT_PENDING``/``RETRY`` each;
- ``{"action": "events"}``: stored and removed keys vLLM's KV events would publish;
- ``{"action": "damage", "dir": D, "files": 1}``: flip bytes in the payload of that many
  chunk files under D, the most recently written first;
- ``{"action": "signal", "file": F}`` / ``{"action": "wait", "file": F}``: write / wait for
  a marker (two processes on one root);
- ``{"action": "settle", "seconds": 2}``: ``os.sync()`` and a pause;
  ``{"action": "uncache", "dir": D}``: drop D's files from the page cache
  (``drop_caches`` when allowed, else ``posix_fadvise(DONTNEED)`` per file);
- ``{"action": "usage", "dir": D}``: bytes the files under D occupy;
- ``{"action": "raw_store", "tier": 0, "seed": 7, "index": 0, "row": R}``: a store job
  submitted straight to that secondary tier (a ``TransferJob`` vLLM's manager would not
  make when ``R`` is outside the CPU tier); records whether the tier reported success.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Seconds a promote or store step waits for vLLM's jobs before giving up.
TIMEOUT_S = 300.0


def process_cpu() -> float:
    """Seconds of CPU this process has used, user and system, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def chunk_key(seed: int, index: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(f"{seed}:{index}".encode()).digest(), 0)


def chunk_bytes(seed: int, index: int, slot: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng([seed, index, slot]).bytes(nbytes), np.uint8)


class Driver:
    """One engine's scheduler side of vLLM's tiered offloading, on the CPU."""

    def __init__(self, plan: dict[str, Any]):
        from vllm.utils.gc_utils import freeze_gc_heap
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.slot = int(plan["row_kib"]) << 10
        self.world = int(plan.get("world_size", 1))
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("model.layers.0.attn",), 0),),
            worker_kv_bytes_per_block=self.slot,
            enable_kv_cache_events=bool(plan.get("events", True)),
            extra_config={
                "cpu_bytes_to_use": int(plan["chunks"]) * self.slot * self.world,
                "secondary_tiers": plan["tiers"],
            },
            engine_id=str(plan["engine_id"]),
            model=OffloadingModelConfig(plan.get("model", "test/model"), "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=self.world, tp_size=self.world, pp_size=1, pcp_size=1,
                dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                data_parallel_rank_local=None, is_parallelism_agnostic=False,
            ),
        )  # fmt: skip
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.view = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self._requests = 0
        # What vLLM's EngineCore does once it is built, before it serves (and where the
        # scheduler, so the manager and its tiers, run): the startup heap (vLLM's and
        # torch's modules) is frozen out of the cyclic collector. Without it a full
        # collection walks that heap while the tiers move bytes, taking the CPU their
        # threads need, and the driver would measure a process the engine never is.
        freeze_gc_heap()

    def close(self) -> None:
        del self.view
        self.manager.shutdown()

    def _request(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._requests += 1
        context = ReqContext(req_id=f"req-{os.getpid()}-{self._requests}")
        self.manager.on_new_request(context)
        return context

    def _step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def _fill(self, row: int, seed: int, index: int) -> None:
        for slot in range(self.world):
            start = slot * self.slot
            self.view[row, start : start + self.slot] = chunk_bytes(seed, index, slot, self.slot)

    def _holds(self, row: int, seed: int, index: int) -> bool:
        return all(
            np.array_equal(
                self.view[row, s * self.slot : (s + 1) * self.slot],
                chunk_bytes(seed, index, s, self.slot),
            )
            for s in range(self.world)
        )

    def _drain(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while self.manager.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM's tier jobs did not finish")
            self._step()
            time.sleep(0.0005)

    def store(
        self, seed: int, count: int, jobs: int, one_request: bool, sync: bool = False
    ) -> dict[str, Any]:
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        batches: list[tuple[Any, list[bytes]]] = []
        per_job = -(-count // max(jobs, 1))
        request = self._request() if one_request else None
        for first in range(0, count, per_job):
            context = request or self._request()
            keys = [chunk_key(seed, i) for i in range(first, min(count, first + per_job))]
            for i, key in enumerate(keys, first):  # as vLLM's scheduler records them
                context.set_offload_key_position(key, (i + 1) * 16)
            prepared = self.manager.prepare_store(keys, context)
            if prepared is None:
                raise RuntimeError("vLLM's CPU tier has no room for the chunks")
            spec = prepared.store_spec
            assert isinstance(spec, CPULoadStoreSpec)
            stored = prepared.keys_to_store
            for key, row in zip(stored, spec.chunk_ids, strict=True):
                self._fill(int(row), seed, keys.index(key) + first)  # vLLM's GPU->CPU copy
            batches.append((context, stored))
        cpu, start = process_cpu(), time.perf_counter()
        for context, stored in batches:
            self.manager.complete_store(stored, context)  # the cascade starts here
        self._drain()
        seconds = time.perf_counter() - start
        out = {
            "seconds": seconds,
            "cpu_seconds": process_cpu() - cpu,
            "bytes": count * self.slot * self.world,
        }
        if sync:  # every row free again above; here every byte on the disk
            os.sync()
            out["synced_seconds"] = time.perf_counter() - start
        for context in {id(c): c for c, _stored in batches}.values():
            self.manager.on_request_finished(context)
        self._drain()
        return out

    def promote(self, seed: int, count: int, jobs: int) -> dict[str, Any]:
        from vllm.v1.kv_offload.base import LookupResult
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        per_job = -(-count // max(jobs, 1))
        requests = [
            (self._request(), range(first, min(count, first + per_job)))
            for first in range(0, count, per_job)
        ]
        state: dict[int, str] = {}
        cpu, start = process_cpu(), time.perf_counter()
        deadline = time.monotonic() + TIMEOUT_S
        while len(state) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count - len(state)} chunks neither promoted nor missed")
            for context, indexes in requests:
                for i in indexes:
                    if i in state:
                        continue
                    result = self.manager.lookup(chunk_key(seed, i), context)
                    if result is LookupResult.HIT:
                        state[i] = "hit"
                    elif result is LookupResult.MISS:
                        state[i] = "miss"
            self._step()
            if len(state) < count:
                time.sleep(0.0005)
        seconds = time.perf_counter() - start
        cpu = process_cpu() - cpu
        hits = sorted(i for i, s in state.items() if s == "hit")
        identical = True
        for context, indexes in requests:
            mine = [i for i in indexes if state[i] == "hit"]
            keys = [chunk_key(seed, i) for i in mine]
            if keys:
                spec = self.manager.prepare_load(keys, context)  # pins the rows
                assert isinstance(spec, CPULoadStoreSpec)
                for i, row in zip(mine, spec.chunk_ids, strict=True):
                    identical &= self._holds(int(row), seed, i)  # vLLM's CPU->GPU copy
                self.manager.complete_load(keys, context)
            self.manager.on_request_finished(context)
        self._drain()
        return {
            "seconds": seconds,
            "cpu_seconds": cpu,
            "hits": hits,
            "misses": sorted(i for i, s in state.items() if s == "miss"),
            "identical": identical,
            "bytes": len(hits) * self.slot * self.world,
        }

    def lookup(self, seed: int, count: int) -> dict[str, Any]:
        context = self._request()
        results = [self.manager.lookup(chunk_key(seed, i), context).name for i in range(count)]
        self._step()
        return {"results": results}

    def raw_store(self, tier: int, seed: int, index: int, row: int) -> dict[str, Any]:
        from vllm.v1.kv_offload.tiering.base import TransferJob

        target = self.manager.secondary_tiers[tier]
        job_id = 1 << 40  # never one of the manager's own
        target.submit_store(
            TransferJob(job_id, [chunk_key(seed, index)], np.array([row]), False, self._request())
        )
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # only this job is in flight: the manager's own have all been drained
            results = list(target.get_finished_jobs())
            assert all(r.job_id == job_id for r in results), results
            if results:
                return {"success": bool(results[0].success)}
            if time.monotonic() > deadline:
                raise TimeoutError("the tier never finished the job")
            time.sleep(0.0005)

    def events(self) -> dict[str, Any]:
        """Keys stored and removed in the events, in all and per medium."""
        counts: dict[str, int] = {}
        for event in self.manager.take_events():
            kind = "removed" if event.removed else "stored"
            medium = getattr(event.medium, "name", str(event.medium))
            for name in (kind, f"{kind}_{medium}"):
                counts[name] = counts.get(name, 0) + len(event.keys)
        return {"stored": 0, "removed": 0, **counts}


def _files(directory: str) -> list[Path]:
    return [p for p in Path(directory).rglob("*") if p.is_file()]


def _payload_files(directory: str) -> list[Path]:
    """Files holding a chunk: Persisting's ``.kv`` payload files, the fs tier's
    ``<block hash>.bin`` files."""
    return [
        p
        for p in _files(directory)
        if p.suffix == ".kv" or (p.suffix == ".bin" and len(p.stem) >= 32)
    ]


def uncache(directory: str) -> str:
    """Drop the page cache: all of it when allowed (root), else ``directory``'s files."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for path in _files(directory):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def damage(directory: str, files: int) -> list[str]:
    """Flip 64 bytes in the payload of ``files`` chunk files (the most recent first)."""
    done = []
    for path in sorted(_payload_files(directory), key=lambda p: -p.stat().st_mtime_ns)[:files]:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size - size // 3)
            chunk = f.read(64)
            f.seek(size - size // 3)
            f.write(bytes(b ^ 0xFF for b in chunk))
        done.append(str(path))
    return done


def run_step(driver: Driver, step: dict[str, Any]) -> dict[str, Any]:
    action = step["action"]
    if action == "store":
        return driver.store(
            step["seed"],
            step["count"],
            step.get("jobs", 1),
            step.get("one_request", False),
            step.get("sync", False),
        )
    if action == "promote":
        return driver.promote(step["seed"], step["count"], step.get("jobs", 1))
    if action == "lookup":
        return driver.lookup(step["seed"], step["count"])
    if action == "events":
        return driver.events()
    if action == "raw_store":
        return driver.raw_store(step["tier"], step["seed"], step["index"], step["row"])
    if action == "damage":
        return {"damaged": damage(step["dir"], step.get("files", 1))}
    if action == "signal":
        Path(step["file"]).write_text("ready")
        return {}
    if action == "wait":
        deadline = time.monotonic() + TIMEOUT_S
        while not Path(step["file"]).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {step['file']}")
            time.sleep(0.05)
        time.sleep(float(step.get("linger", 0)))
        return {}
    if action == "settle":
        os.sync()
        time.sleep(float(step.get("seconds", 2.0)))
        return {}
    if action == "uncache":
        return {"how": uncache(step["dir"])}
    if action == "usage":
        files = _files(step["dir"])
        return {
            "bytes": sum(p.stat().st_blocks * 512 for p in files),
            "payload_files": len(_payload_files(step["dir"])),
        }
    raise ValueError(f"unknown action {action!r}")


def main(argv: list[str]) -> None:
    plan_file, out_file = Path(argv[0]), Path(argv[1])
    plan = json.loads(plan_file.read_text())
    out: dict[str, Any] = {"pid": os.getpid(), "steps": []}
    driver = Driver(plan)
    try:
        for step in plan["steps"]:
            out["steps"].append({"action": step["action"], **run_step(driver, step)})
            out_file.write_text(json.dumps(out))
    finally:
        driver.close()
    out["closed"] = True
    out_file.write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
