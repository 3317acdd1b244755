"""Concurrent puts and gets from several threads: never wrong data, nothing leaked."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from tests.lmcache.lmcache_harness import (
    cpu_of,
    filled,
    key,
    make_config,
    payload,
    plugin_of,
    same_bytes,
    storage_manager,
)

pytestmark = pytest.mark.timeout(180)

THREADS, PER_THREAD = 4, 12


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_concurrent_puts_and_gets(root: Path, durability: str) -> None:
    with storage_manager(make_config(root, cpu_gb=0.1, durability=durability)) as manager:
        plugin = plugin_of(manager)
        cpu = cpu_of(manager)
        errors: list[BaseException] = []
        wrong: list[int] = []
        all_objs = []
        lock = threading.Lock()
        start = threading.Barrier(THREADS)

        def worker(t: int) -> None:
            rng = random.Random(t)
            # Half of each thread's keys are shared with the next thread: duplicate puts race.
            mine = [t * PER_THREAD // 2 + j for j in range(PER_THREAD)]
            objs = [filled(cpu, i) for i in mine]
            with lock:
                all_objs.extend(objs)
            try:
                start.wait()
                for j in range(0, PER_THREAD, 3):
                    plugin.batched_submit_put_task(
                        [key(i) for i in mine[j : j + 3]], objs[j : j + 3]
                    )
                    probe = rng.randrange(THREADS * PER_THREAD)
                    got = plugin.get_blocking(key(probe))
                    if got is not None:
                        if not same_bytes(
                            got.tensor, payload(probe, got.tensor.shape, got.tensor.dtype)
                        ):
                            wrong.append(probe)
                        got.ref_count_down()
                    batch = plugin.batched_get_blocking([key(i) for i in range(probe, probe + 3)])
                    for offset, obj in enumerate(batch):
                        if obj is None:
                            continue
                        i = probe + offset
                        if not same_bytes(
                            obj.tensor, payload(i, obj.tensor.shape, obj.tensor.dtype)
                        ):
                            wrong.append(i)
                        obj.ref_count_down()
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors and not wrong
        plugin.flush()
        stored = sorted(
            {t * PER_THREAD // 2 + j for t in range(THREADS) for j in range(PER_THREAD)}
        )
        keys = [key(i) for i in stored]
        assert plugin.batched_contains(keys) == len(keys)
        for i, obj in zip(stored, plugin.batched_get_blocking(keys), strict=True):
            assert obj is not None and same_bytes(
                obj.tensor, payload(i, obj.tensor.shape, obj.tensor.dtype)
            )
            obj.ref_count_down()
        assert all(obj.get_ref_count() == 1 for obj in all_objs)  # every put released its ref
        assert plugin.stats()["put_failed"] == 0
        for obj in all_objs:
            obj.ref_count_down()
        assert cpu.get_memory_allocator().memcheck()
