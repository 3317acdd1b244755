"""The CPU worker's threads are not left on the one CPU vLLM bound their creator to
(persisting/integrations/vllm/affinity.py): a thread pinned to one CPU -- as libgomp pins a
vLLM CPU worker's main thread -- starts pool threads that may run on every CPU of the
process."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from persisting.integrations.vllm.affinity import process_cpus, run_on

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux CPU masks and at least two CPUs",
)


def _from_a_pinned_thread(initializer: bool) -> tuple[frozenset[int] | None, set[int]]:
    """Pin a new thread to one CPU, start a one-thread pool from it (with or without
    ``run_on``), and return what the pool thread may run on."""
    out: dict[str, object] = {}

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        cpus = process_cpus()
        pool = ThreadPoolExecutor(1, initializer=run_on, initargs=(cpus if initializer else None,))
        with pool:
            out["mask"] = pool.submit(os.sched_getaffinity, 0).result()
        out["cpus"] = cpus

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    return out["cpus"], out["mask"]  # type: ignore[return-value]


def test_a_pool_started_from_a_pinned_thread_runs_on_every_cpu_of_the_process() -> None:
    cpus, mask = _from_a_pinned_thread(initializer=True)
    assert cpus == frozenset(os.sched_getaffinity(0))  # this thread is not pinned
    assert mask == set(cpus)


def test_without_it_the_pool_inherits_the_single_cpu() -> None:
    """What the worker's pools would get otherwise (Linux hands a thread its creator's mask)."""
    _cpus, mask = _from_a_pinned_thread(initializer=False)
    assert len(mask) == 1


def test_run_on_nothing_leaves_the_mask() -> None:
    before = os.sched_getaffinity(0)
    run_on(None)
    run_on(())
    assert os.sched_getaffinity(0) == before
