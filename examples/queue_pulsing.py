"""The Lance queue with Pulsing's own queue API: records that survive a restart.

``persisting.queue.LanceBackend`` is a storage backend for ``pulsing.streaming`` queues.
Register it, then ``write_queue`` / ``read_queue`` (here through ``open_writer`` /
``open_reader``, which put the topic into the path) store each bucket as a Lance dataset
under ``<storage_path>/queue/<topic>/bucket_<id>/``.

    .venv/bin/python examples/queue_pulsing.py                      # a temporary root
    .venv/bin/python examples/queue_pulsing.py --storage-path ./queue-demo

The script writes records in one actor system, then reads them back from a fresh Python
process (a restart), then resumes a named consumer from its committed position.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pulsing
from pulsing.streaming import register_backend

from persisting.queue import LanceBackend, QueueConsumer, close_all, open_reader, open_writer

TOPIC = "prefill/requests"  # '/' is fine: the topic is encoded into one directory name
BUCKETS = 2


async def write(root: Path) -> None:
    # Register in every process of the cluster (persisting.queue.register() does all names).
    register_backend("lance", LanceBackend)
    system = await pulsing.actor_system()
    try:
        writer = await open_writer(system, TOPIC, storage_root=root, num_buckets=BUCKETS)
        for i in range(10):
            # Each top-level key becomes a typed Lance column; arrays keep dtype and shape.
            await writer.put(
                {"id": f"req-{i}", "prompt_tokens": 100 + i, "embedding": np.arange(4.0) * i}
            )
        await writer.flush()  # durable in Lance (the write-ahead log made each put durable)
        reader = await open_reader(system, TOPIC, storage_root=root, num_buckets=BUCKETS)
        records = await reader.get(limit=100)
        print(f"wrote and read back {len(records)} records in this process")
    finally:
        close_all()  # Pulsing never closes a bucket's backend: flush and close them all
        await system.shutdown()


async def read_after_restart(root: Path) -> None:
    """Runs in a fresh process: nothing is in memory, everything comes from disk."""
    register_backend("lance", LanceBackend)
    system = await pulsing.actor_system()
    try:
        reader = await open_reader(system, TOPIC, storage_root=root, num_buckets=BUCKETS)
        records = sorted(await reader.get(limit=100), key=lambda r: r["prompt_tokens"])
        last = records[-1]
        print(
            f"after a restart: {len(records)} records; last: id={last['id']} "
            f"prompt_tokens={last['prompt_tokens']} embedding={last['embedding'].tolist()}"
        )
    finally:
        close_all()
        await system.shutdown()


async def consume(root: Path) -> None:
    """A named consumer of bucket 0 that commits its position and resumes from it."""
    consumer = QueueConsumer.open(root, TOPIC, 0, "billing")
    batch = await consumer.poll(3)
    await consumer.commit()  # durable: the next consumer named "billing" starts after these
    print(f"consumer 'billing' read offsets {[o for o, _ in batch]} and committed")
    await consumer.close()
    again = QueueConsumer.open(root, TOPIC, 0, "billing")
    rest = await again.poll(100)
    print(f"reopened 'billing' resumed at offset {rest[0][0]} ({len(rest)} more records)")
    await again.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", type=Path, help="storage root (default: a temp dir)")
    parser.add_argument("--read-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read_only:  # the "restarted" process
        asyncio.run(read_after_restart(args.storage_path))
        sys.stdout.flush()
        os._exit(0)  # Pulsing 0.1.2 may crash at interpreter exit after a shutdown

    temporary = tempfile.TemporaryDirectory(prefix="persisting-example-")
    with contextlib.nullcontext(args.storage_path) if args.storage_path else temporary as tmp:
        root = Path(tmp).absolute()
        print(f"storage root: {root}")
        asyncio.run(write(root))
        for bucket in sorted((root / "queue").glob("*/bucket_*")):
            print(f"  {bucket.relative_to(root)}/data.lance")
        sys.stdout.flush()
        restart = [sys.executable, __file__, "--read-only", "--storage-path", str(root)]
        subprocess.run(restart, check=True, timeout=120)
        asyncio.run(consume(root))
    print("queue_pulsing: done")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
