"""A server's owner lock holds even when its file is pulled (issue 39, item 4): after
``rm <root>/kv/.owners/<model>/.owner.lock`` under a live ``persisting serve``, the server
locks a new file and a second server is refused; a server that finds another process has
claimed its namespace meanwhile stops serving, with a line saying why and a failing exit
status. Real server processes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from persisting.lance_store import StorageRoot
from persisting.lance_store.ownership import is_claimed
from tests.service.service_helpers import (
    MODEL,
    free_port,
    processes,
    start_serve,
    wait_for_log,
)
from tests.timing import wait_until

pytestmark = pytest.mark.slow


def test_a_pulled_owner_lock_is_taken_again_or_the_server_stops(tmp_path: Path) -> None:
    root = tmp_path / "root"
    lock = StorageRoot(root).model_claim_dir(MODEL) / ".owner.lock"
    with processes() as procs:
        first_log = tmp_path / "first.log"
        first = start_serve(root, free_port(), first_log)
        procs.append(first)
        wait_for_log(first_log, "persisting: serving", first)

        # Pulled while the server runs: it locks a new file, and a second server is refused.
        pulled = lock.stat().st_ino
        lock.unlink()
        wait_until(
            lambda: lock.exists() and lock.stat().st_ino != pulled and is_claimed(lock.parent),
            "the server's new owner lock",
        )
        second_log = tmp_path / "second.log"
        second = start_serve(root, free_port(), second_log)
        procs.append(second)
        assert second.wait(timeout=120) != 0
        assert f"is already held by pid {first.pid} " in second_log.read_text()

        # Pulled and claimed by another process before the server could lock a new file
        # (it is stopped meanwhile): it stops serving, loudly.
        os.killpg(first.pid, signal.SIGSTOP)
        lock.unlink()
        other = StorageRoot(root).claim_model(MODEL, "l2-adapter", "another owner")
        os.killpg(first.pid, signal.SIGCONT)
        assert first.wait(timeout=120) == 1
        log = first_log.read_text()
        assert f"the owner lock {lock} of model {MODEL!r}" in log
        assert f"pid {os.getpid()} " in log and "this server stops" in log
        owner = StorageRoot(root).model_owner(MODEL)
        assert owner is not None and owner.live and owner.pid == os.getpid()
        other.release()
