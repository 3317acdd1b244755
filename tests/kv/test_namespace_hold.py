"""Dropping a model that a live store holds is refused (issue 13, item 13): every open
store, in any process, holds its namespace; a drop never waits and never pulls a live
server's files away. A killed holder lets go."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from persisting.errors import NamespaceInUseError
from persisting.kv import open_kv_store
from persisting.lance_store import StorageRoot
from tests import child_env
from tests.kv.kv_helpers import MODEL, key, tensor

MiB = 1 << 20

HOLDER = """
import sys
from tests.kv.kv_helpers import MODEL, key, tensor
from persisting.kv import open_kv_store
store = open_kv_store(sys.argv[1], MODEL, memory_bytes=0, disk_bytes=64 << 20)
store.put(key(7), tensor(7))
print("open", flush=True)
sys.stdin.readline()
print("held", store.contains(key(7)), flush=True)
store.close()
"""


def start_holder(root: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "open"
    return holder


def test_drop_refuses_while_a_store_of_this_process_is_open(root: Path) -> None:
    storage = StorageRoot(root)
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as store:
        store.put(key(1), tensor(1))
        with pytest.raises(NamespaceInUseError, match="live store"):
            storage.drop_model(MODEL)
        store.put(key(2), tensor(2))  # still whole and writable
        assert torch.equal(store.get(key(1)), tensor(1))
    assert storage.drop_model(MODEL) is True
    assert storage.list_models() == []
    assert storage.drop_model(MODEL) is False
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as fresh:
        assert not fresh.contains(key(1))


def test_drop_refuses_while_another_process_serves_the_model(root: Path) -> None:
    holder = start_holder(root)
    try:
        with pytest.raises(NamespaceInUseError):
            StorageRoot(root).drop_model(MODEL)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("go on\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split() == ["held", "True"]
        assert holder.wait(60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
    assert StorageRoot(root).drop_model(MODEL) is True


def test_a_killed_holder_does_not_block_a_drop(root: Path) -> None:
    holder = start_holder(root)
    holder.send_signal(signal.SIGKILL)
    holder.wait(60)
    assert StorageRoot(root).drop_model(MODEL) is True


def test_the_cli_says_why_it_will_not_drop(root: Path) -> None:
    cli = Path(sys.executable).parent / "persisting"
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as store:
        store.put(key(1), tensor(1))
        out = subprocess.run(
            [str(cli), "drop", MODEL, "--yes", "--storage-path", str(root)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 1, out
        assert "live store" in " ".join(out.stderr.split())
        assert torch.equal(store.get(key(1)), tensor(1))
