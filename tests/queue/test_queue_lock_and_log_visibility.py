"""Two rules of a bucket's files (issue 25, item 4): the writer lock is private, and what
a dead writer acknowledged into its log is read by other processes once a writer opens the
bucket again (docs/queue.md, "Readers in other processes")."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
from pathlib import Path

from persisting.queue import LanceBackend
from persisting.queue.ownership import LOCK_FILE
from tests import child_env

N = 25

ACK_THEN_DIE = """
import asyncio, os, signal, sys
from persisting.queue import LanceBackend

async def main():
    backend = LanceBackend(bucket_id=0, storage_path=sys.argv[1], batch_size=10**9,
                           flush_interval_s=3600)  # nothing reaches Lance before the kill
    for i in range(int(sys.argv[2])):
        await backend.put({"seq": i})  # acknowledged: in the fsynced log
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_writer_lock_is_0600_and_an_older_0644_one_is_tightened(bucket_dir: Path) -> None:
    backend = LanceBackend(bucket_id=0, storage_path=bucket_dir)
    try:
        assert mode_of(bucket_dir / LOCK_FILE) == 0o600
    finally:
        backend.close()
    (bucket_dir / LOCK_FILE).chmod(0o644)  # as versions before this one created it
    backend = LanceBackend(bucket_id=0, storage_path=bucket_dir)
    try:
        assert mode_of(bucket_dir / LOCK_FILE) == 0o600
    finally:
        backend.close()


def read_all(bucket_dir: Path) -> list[int]:
    reader = LanceBackend(bucket_id=0, storage_path=bucket_dir, read_only=True)
    try:
        return [r["seq"] for r in asyncio.run(reader.get(limit=10 * N, offset=0))]
    finally:
        reader.close()


def test_a_dead_writers_logged_records_are_read_once_a_writer_opens_the_bucket(
    bucket_dir: Path,
) -> None:
    bucket_dir.mkdir(parents=True)
    killed = subprocess.run(
        [sys.executable, "-c", ACK_THEN_DIE, str(bucket_dir), str(N)],
        env=child_env(),
        timeout=120,
    )
    assert killed.returncode == -9
    # Acknowledged and durable, but in the dead writer's log: not in Lance yet.
    assert read_all(bucket_dir) == []
    writer = LanceBackend(bucket_id=0, storage_path=bucket_dir)  # replays the log, flushes
    writer.close()
    assert read_all(bucket_dir) == list(range(N))
