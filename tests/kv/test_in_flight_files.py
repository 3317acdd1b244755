"""In-flight payload files (issue 13, items 6 and 15): only their writer, or a provably
dead writer, removes them -- two stores of one process, processes in another pid
namespace -- and a writer killed mid-batch gives its reservation back when noticed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import file_size, round_to_block
from tests import child_env
from tests.kv.kv_helpers import MODEL, OVERHEAD_ROOM, big, disk_tier, in_flight, key, tensor

MiB = 1 << 20


def pause_writes(store, started: threading.Event, go: threading.Event) -> None:
    """Make ``store``'s writer stop after creating its tmp files, until ``go``."""
    files = disk_tier(store).files
    real = files.publish

    def finish(*args, **kwargs):
        started.set()
        assert go.wait(60)
        return real(*args, **kwargs)

    files.publish = finish


def test_two_stores_of_one_process_keep_each_others_in_flight_files(root: Path) -> None:
    first = open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB)
    started, go = threading.Event(), threading.Event()
    pause_writes(first, started, go)
    outcome: list[object] = []

    def put() -> None:
        try:
            outcome.extend(
                first.batched_put([key(i) for i in range(10)], [tensor(i) for i in range(10)])
            )
        except Exception as exc:
            outcome.append(exc)

    writer = threading.Thread(target=put)
    writer.start()
    try:
        assert started.wait(60)
        writing = in_flight(first.directory)
        assert len(writing) == 10
        with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as second:
            # Opening recounts the directory's usage: the first store's files must survive.
            assert in_flight(first.directory) == writing
            go.set()
            writer.join(60)
            assert all(getattr(r, "stored", False) for r in outcome), outcome
            assert second.refresh() == 10
            assert all(torch.equal(second.get(key(i)), tensor(i)) for i in range(10))
    finally:
        go.set()
        writer.join(60)
        first.close()


WRITER_IN_ANOTHER_NAMESPACE = """
import os, sys, threading
from tests.kv.kv_helpers import MODEL, disk_tier, key, tensor
from persisting.kv import open_kv_store
root, go_file = sys.argv[1], sys.argv[2]
store = open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 << 20)
files = disk_tier(store).files
real = files.publish
told = []
def finish(*args, **kwargs):
    if not told:
        told.append(print("writing", os.getpid(), flush=True))
    while not os.path.exists(go_file):
        threading.Event().wait(0.01)
    return real(*args, **kwargs)
files.publish = finish
results = store.batched_put([key(i) for i in range(3)], [tensor(i) for i in range(3)])
store.close()
print("stored", sum(r.stored for r in results), flush=True)
"""


def in_new_pid_namespace() -> list[str]:
    """A command prefix that runs a process in a new pid namespace, where this host allows
    it (root in CI); elsewhere nothing, and the writer is merely another process."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    probe = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True)
    return [unshare, "--pid", "--fork"] if probe.returncode == 0 else []


@pytest.mark.slow
def test_a_writer_in_another_pid_namespace_keeps_its_in_flight_files(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as mine:
        go = root / "go"
        child = subprocess.Popen(
            [
                *in_new_pid_namespace(),
                sys.executable,
                "-c",
                WRITER_IN_ANOTHER_NAMESPACE,
                str(root),
                str(go),
            ],
            env=child_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline().split()
            assert line[:1] == ["writing"], line
            tmp = in_flight(mine.directory)
            assert len(tmp) == 3
            # Another store opens (and recounts), and a full directory would reclaim:
            # neither may take a live writer's files for dead, whatever its pid means here.
            with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as other:
                assert in_flight(mine.directory) == tmp
                disk = disk_tier(other)
                with disk.usage.locked():
                    assert disk.usage.reclaim_abandoned(disk.files) == 0
                assert in_flight(mine.directory) == tmp
            go.touch()
            assert child.stdout.readline().split() == ["stored", "3"]
            assert child.wait(60) == 0
        finally:
            go.touch()
            if child.poll() is None:
                child.kill()
            child.wait()
        mine.refresh()
        assert all(torch.equal(mine.get(key(i)), tensor(i)) for i in range(3))


KILLED_MID_BATCH = """
import os, signal, sys
from tests.kv.kv_helpers import MODEL, big, disk_tier, key
from persisting.kv import open_kv_store
store = open_kv_store(sys.argv[1], MODEL, memory_bytes=0, disk_bytes=int(sys.argv[2]))
files = disk_tier(store).files
real = files.publish
done = []
def finish(*args, **kwargs):
    if len(done) == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # one file written, seven still reserved
    done.append(real(*args, **kwargs))
    return done[-1]
files.publish = finish
store.batched_put([key(100 + i) for i in range(8)], [big(100 + i) for i in range(8)])
"""


def test_a_writer_killed_mid_batch_gives_its_reservation_back(root: Path) -> None:
    per_file = file_size(big(0).numel() * 2)
    capacity = 16 * per_file + OVERHEAD_ROOM
    mine = [key(i) for i in range(10)]
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=capacity) as store:
        store.batched_put(mine[:6], [big(i) for i in range(6)])
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_MID_BATCH, str(root), str(capacity)],
            env=child_env(),
            timeout=120,
        )
        assert killed.returncode == -9
        assert len(in_flight(store.directory)) == 7
        assert disk_tier(store).usage.get() == (6 + 8) * per_file  # the dead writer's reservation
        # 6 + 8 + 4 files would not fit: the dead reservation must go, not my values.
        store.batched_put(mine[6:], [big(i) for i in range(6, 10)])
        stats = store.stats()
        assert stats["disk_evictions"] == 0
        assert stats["reclaimed_bytes"] == 7 * per_file
        assert all(torch.equal(store.get(k), big(i)) for i, k in enumerate(mine))
        assert in_flight(store.directory) == []
        on_disk = sum(round_to_block(p.stat().st_size) for p in store.directory.rglob("*.kv"))
        assert disk_tier(store).usage.get() == on_disk == 11 * per_file
