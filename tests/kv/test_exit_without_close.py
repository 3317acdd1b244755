"""A process that exits without closing its store exits cleanly (issue 25, item 2).

The abort seen in the field (SIGABRT, "FATAL: exception not rethrown", exit 134) came from
the store's metadata thread being inside a Lance commit when the interpreter finalized: the
daemon thread is unwound through Lance's Rust frames, which swallow the unwind. It was
rare because the window is a commit's length; these tests make every run hit it, by
exiting the moment the metadata thread enters Lance. Each child runs 20 times; all must
exit 0, and what was acknowledged must be on disk afterwards.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from persisting.kv import open_kv_store
from tests import child_env
from tests.kv.kv_helpers import disk_tier
from tests.reliability.rel_common import MODEL, key_text, value

MiB = 1 << 20
RUNS = 20
KEYS = 24
DAMAGED = 6

#: Exit right after the metadata thread entered a Lance call (``LanceTable.<name>``).
EXIT_INSIDE_LANCE = """
import threading
from persisting.lance_store.table import LanceTable
entered = threading.Event()
def watch(name):
    real = getattr(LanceTable, name)
    def call(self, *args, **kwargs):
        entered.set()
        return real(self, *args, **kwargs)
    setattr(LanceTable, name, call)
"""

DAMAGED_READS = (
    EXIT_INSIDE_LANCE
    + """
import sys
from tests.reliability.rel_common import MODEL, key_text
from persisting.kv import open_kv_store
watch("delete")
store = open_kv_store(sys.argv[1], MODEL, memory_bytes=0, disk_bytes=64 << 20)
got = store.batched_get([key_text(i) for i in range(int(sys.argv[2]))])
assert sum(v is None for v in got) == int(sys.argv[3]), got
assert store.stats()["corruptions"] == int(sys.argv[3])
assert entered.wait(60)  # dropping the damaged values: a Lance delete is under way
"""
)

WRITE_BEHIND = (
    EXIT_INSIDE_LANCE
    + """
import sys
from tests.reliability.rel_common import MODEL, key_text, value
from persisting.kv import open_kv_store
watch("append")
store = open_kv_store(sys.argv[1], MODEL, memory_bytes=64 << 20, disk_bytes=64 << 20,
                      durability="async")
first = int(sys.argv[2])
results = store.batched_put([key_text(i) for i in range(first, first + 8)],
                            [value(i, 256) for i in range(first, first + 8)], fmt="KV_2TD")
assert all(r.stored and not r.durable for r in results)  # acknowledged from memory
if sys.argv[3] == "in-lance":
    assert entered.wait(60)  # the write-behind's metadata commit is under way
"""
)


def run_children(script: str, argv: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` once per argument list, four at a time."""

    def one(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script, *args],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, argv))


def damaged_store(root: Path) -> None:
    """``KEYS`` values, ``DAMAGED`` of them with a flipped payload byte."""
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.batched_put(
            [key_text(i) for i in range(KEYS)], [value(i, 64) for i in range(KEYS)], fmt="KV_2TD"
        )
        disk = disk_tier(store)
        texts = [key_text(i) for i in range(DAMAGED)]
        paths = [disk.files.path(t, disk.index.get(t).tag) for t in texts]  # type: ignore[union-attr]
    for path in paths:
        with open(path, "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.timeout(600)
def test_exiting_without_close_after_damaged_reads_exits_cleanly_every_time(
    tmp_path: Path,
) -> None:
    template = tmp_path / "template"
    damaged_store(template)
    roots = []
    for run in range(RUNS):
        roots.append(tmp_path / f"run{run}")
        shutil.copytree(template, roots[-1])
    done = run_children(DAMAGED_READS, [[str(r), str(KEYS), str(DAMAGED)] for r in roots])
    codes = [d.returncode for d in done]
    assert codes == [0] * RUNS, [(d.returncode, d.stderr[-800:]) for d in done if d.returncode]
    # What the children dropped stays dropped; every intact value is still there.
    for r in roots[:3]:
        with open_kv_store(r, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
            got = store.batched_get([key_text(i) for i in range(KEYS)])
            assert all(v is None for v in got[:DAMAGED])
            intact = got[DAMAGED:]
            assert all(np.array_equal(v, value(i + DAMAGED, 64)) for i, v in enumerate(intact))
            assert store.stats()["corruptions"] == 0


@pytest.mark.timeout(600)
def test_exiting_without_close_after_write_behind_puts_exits_cleanly_and_keeps_them(
    tmp_path: Path,
) -> None:
    """Half the runs exit at once after the puts are acknowledged, half once the
    write-behind's metadata commit is inside Lance: exit 0 every time, and every
    acknowledged value is durable."""
    roots = [tmp_path / f"run{run}" for run in range(RUNS)]
    argv = [
        [str(r), str(100 * run), "in-lance" if run % 2 else "at-once"]
        for run, r in enumerate(roots)
    ]
    done = run_children(WRITE_BEHIND, argv)
    codes = [d.returncode for d in done]
    assert codes == [0] * RUNS, [(d.returncode, d.stderr[-800:]) for d in done if d.returncode]
    for run, r in enumerate(roots):
        with open_kv_store(r, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
            first = 100 * run
            got = store.batched_get([key_text(i) for i in range(first, first + 8)])
            assert all(v is not None for v in got), f"run {run}: write-behind values lost"
            assert all(np.array_equal(v, value(first + i, 256)) for i, v in enumerate(got))
