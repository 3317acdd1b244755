"""Several processes on one model directory, and a writer killed with SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import file_size
from persisting.lance_store import StorageRoot
from tests import child_env
from tests.kv.kv_helpers import (
    MODEL,
    OVERHEAD_ROOM,
    big,
    in_flight,
    key,
    shared_dir_worker,
    tensor,
)

MiB = 1 << 20


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_processes_sharing_a_directory_never_read_wrong_data(root: Path) -> None:
    value_file = file_size(big(0).numel() * 2)
    capacity = 12 * value_file + OVERHEAD_ROOM  # far fewer than 40 keys: constant eviction
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=shared_dir_worker, args=(str(root), w, capacity, 150, barrier, results))
        for w in range(3)
    ]
    for p in procs:
        p.start()
    try:
        outcome = [results.get(timeout=200) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert sum(o[1] for o in outcome) == 0, outcome  # no wrong data, ever
    assert sum(o[2] for o in outcome) > 0  # and real hits, including the others' chunks
    payload = StorageRoot(root).kv_path(MODEL) / "payload"
    on_disk = sum(p.stat().st_size for p in payload.rglob("*.kv"))
    assert on_disk <= capacity  # capacity holds for the directory as a whole
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=capacity) as store:
        present = [i for i in range(40) if store.contains(key(i))]
        assert present
        assert all(torch.equal(store.get(key(i)), big(i)) for i in present)


def test_a_process_sees_the_other_processes_chunks_after_refresh(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as mine:
        mine.put(key(0), tensor(0))
        code = (
            "import sys;"
            "from tests.kv.kv_helpers import MODEL, key, tensor;"
            "from persisting.kv import open_kv_store;"
            "s = open_kv_store(sys.argv[1], MODEL, memory_bytes=0, disk_bytes=64 << 20);"
            "assert s.contains(key(0)); s.put(key(1), tensor(1)); s.remove(key(0)); s.close()"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(root)],
            env=child_env(),
            check=True,
            timeout=120,
        )
        assert not mine.contains(key(1))
        mine.refresh()
        assert mine.contains(key(1)) and not mine.contains(key(0))
        assert torch.equal(mine.get(key(1)), tensor(1))


WRITER = """
import sys
from tests.kv.kv_helpers import MODEL, key, tensor
from persisting.kv import open_kv_store
store = open_kv_store(sys.argv[1], MODEL, memory_bytes=0, disk_bytes=1 << 30, durability="sync")
i = int(sys.argv[2])
while True:
    store.put(key(i), tensor(i, tokens=64))
    print(i, flush=True)  # acknowledged
    i += 1
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_loses_no_acknowledged_sync_put(root: Path) -> None:
    acked: list[int] = []
    start = 0
    for kill in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(start)],
            env=child_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        target = 5 + 3 * kill
        got = 0
        while got < target:  # each line blocks until the writer acknowledges a put
            line = proc.stdout.readline()
            if not line:
                break
            acked.append(int(line))
            got += 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        start = acked[-1] + 1 + 100  # unacknowledged keys in between may or may not exist
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 30) as store:
        for i in acked:
            got = store.get(key(i))
            assert got is not None, f"acknowledged put {i} lost"
            assert torch.equal(got, tensor(i, tokens=64))
        tmp = in_flight(StorageRoot(root).kv_path(MODEL))
        assert tmp == []  # torn writes of dead processes are cleaned up, never visible
