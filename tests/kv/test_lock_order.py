"""The store's locks are taken in the order persisting.kv.lock_order writes down.

The checker records, per thread, what each lock was taken under; a concurrent workload of
two stores sharing one directory (puts written behind and through, gets, lookups, pins,
removes, memory and disk eviction, refreshes, metadata commits) must take no lock under
one that comes after it, and must go through the nestings the order is about.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch

from persisting.errors import CapacityError
from persisting.kv import lock_order, open_kv_store
from persisting.kv.lock_order import Rank, checking, ordered
from tests.kv.kv_helpers import MODEL, OVERHEAD_ROOM, key, tensor

VALUE_BYTES = tensor(0).numel() * tensor(0).element_size()


def test_the_checker_reports_a_lock_taken_under_a_later_one_but_not_a_reentry() -> None:
    with checking() as log:
        tiers = ordered(Rank.TIERS, threading.RLock())
        disk = ordered(Rank.DISK_INDEX, threading.RLock())
        with tiers, disk, tiers:  # in order, then a re-entry: waits for nothing
            pass
        assert log.inversions == []
        with disk, tiers:
            pass
    assert len(log.inversions) == 1 and "took TIERS while holding DISK_INDEX" in log.inversions[0]
    assert (Rank.TIERS, Rank.DISK_INDEX) in log.pairs


def test_checking_off_leaves_the_lock_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lock_order, "_enabled", False)  # as outside tests/kv (conftest.py)
    lock = threading.Lock()
    assert ordered(Rank.TIERS, lock) is lock


def _run(workers: list[threading.Thread]) -> None:
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert not worker.is_alive()


def test_a_concurrent_workload_takes_the_store_s_locks_in_order(root: Path) -> None:
    budget = OVERHEAD_ROOM + 24 * (VALUE_BYTES + 8192)  # room for some of the 64 keys
    errors: list[BaseException] = []

    def guarded(body):  # type: ignore[no-untyped-def]
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # reported by the test, not lost in a thread
                errors.append(exc)

        return threading.Thread(target=run)

    with checking() as log:
        writer = open_kv_store(
            root, MODEL, memory_bytes=8 * VALUE_BYTES, disk_bytes=budget, durability="async"
        )
        other = open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget)
        try:

            def put_behind() -> None:
                for start in range(0, 64, 4):
                    keys = [key(i) for i in range(start, start + 4)]
                    # A batch the full tier cannot take is fine here: the order is the point.
                    with contextlib.suppress(CapacityError):
                        writer.batched_put(keys, [tensor(i) for i in range(start, start + 4)])
                writer.flush()

            def put_through_and_refresh() -> None:
                for i in range(64, 96):
                    with contextlib.suppress(CapacityError):
                        other.put(key(i), tensor(i))
                    if i % 4 == 0:
                        other.refresh()
                        other.remove(key(i - 2))
                other.flush()

            def read() -> None:
                for round_no in range(40):
                    numbers = [(round_no + j) % 96 for j in range(8)]
                    keys = [key(i) for i in numbers]
                    for got, i in zip(writer.batched_get(keys), numbers, strict=True):
                        assert got is None or torch.equal(got, tensor(i))
                    writer.lookup_prefix(keys)
                    writer.batched_contains(keys)
                    writer.stats()

            def pin_and_remove() -> None:
                for i in range(0, 64, 3):
                    writer.pin(key(i))
                    writer.stored_keys()
                    writer.unpin(key(i))
                    writer.remove(key(i), force=i % 2 == 0)
                    writer.refresh()

            _run([guarded(body) for body in (put_behind, put_through_and_refresh, read)])
            _run([guarded(pin_and_remove), guarded(read)])
        finally:
            other.close()
            writer.close()
    assert errors == []
    assert log.inversions == []
    # The nestings the order is about were all exercised.
    assert {
        (Rank.METADATA_COMMIT, Rank.METADATA_FLOCK),  # a commit reserves its growth
        (Rank.METADATA_FLOCK, Rank.USAGE_FLOCK),
        (Rank.USAGE_FLOCK, Rank.DISK_INDEX),  # eviction and refresh under the usage lock
        (Rank.USAGE_FLOCK, Rank.METADATA_PENDING),  # eviction queues its rows' deletion
        (Rank.TIERS, Rank.DISK_INDEX),  # pins
    } <= log.pairs
