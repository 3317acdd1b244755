"""Processes the queue tests start: writers to kill, Pulsing producers and consumers.

Run as ``python queue_procs.py <role> <json arguments>``. Writers append one line per
acknowledged put to an ack file (a plain ``write``, which survives the writer's SIGKILL);
readers print one JSON line with what they read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests.timing import wait_until_async


def record(i: int) -> dict[str, Any]:
    """The i-th record the writers put: typed fields, bytes and an array."""
    return {
        "id": f"r{i}",
        "seq": i,
        "even": i % 2 == 0,
        "blob": bytes([i % 256]) * (i % 40),
        "vec": np.full(3, i, dtype=np.int32),
    }


def summary(rec: dict[str, Any]) -> list[Any]:
    """A JSON-able fingerprint of a record, to compare with :func:`record`."""
    return [
        rec["id"],
        rec["seq"],
        rec["even"],
        rec["blob"].hex(),
        rec["vec"].dtype.str,
        rec["vec"].tolist(),
    ]


class Acks:
    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def ack(self, *seqs: int) -> None:
        os.write(self._fd, "".join(f"{s}\n" for s in seqs).encode())


async def writer(args: dict[str, Any]) -> None:
    """Put records into a bucket directly (no flush) forever, acknowledging each."""
    from persisting.queue import LanceBackend

    backend = LanceBackend(
        bucket_id=0,
        storage_path=args["bucket_dir"],
        batch_size=10**9,
        flush_interval_s=0,
        **args.get("options", {}),
    )
    acks = Acks(args["acks"])
    i = 0
    while True:
        if i % 5 == 0:  # batches too: a batch is acknowledged as a whole
            await backend.put_batch([record(i), record(i + 1), record(i + 2)])
            acks.ack(i, i + 1, i + 2)
            i += 3
        else:
            await backend.put(record(i))
            acks.ack(i)
            i += 1


async def pulsing_writer(args: dict[str, Any]) -> None:
    """Host a queue bucket in this process's actor system and put records forever."""
    import pulsing as pul

    from persisting.queue import open_writer

    system = await pul.actor_system()
    queue = await open_writer(
        system,
        args["topic"],
        storage_root=args["root"],
        num_buckets=1,
        batch_size=10**9,
        backend_options={"flush_interval_s": 0},
    )
    acks = Acks(args["acks"])
    i = 0
    while True:
        await queue.put(record(i))
        acks.ack(i)
        i += 1


async def pulsing_reader(args: dict[str, Any]) -> None:
    """Open the topic through a fresh actor system and print every record's summary."""
    import pulsing as pul

    from persisting.queue import close_all, open_reader

    system = await pul.actor_system()
    reader = await open_reader(system, args["topic"], storage_root=args["root"], num_buckets=1)
    records = await reader.get(limit=args["count"] + 1000)
    print(json.dumps([summary(r) for r in records]), flush=True)
    close_all()
    await system.shutdown()


async def pulsing_producer(args: dict[str, Any]) -> None:
    """A cluster's first node: hosts the buckets, puts half, then the rest once a reader joined."""
    import pulsing as pul

    from persisting.queue import open_writer

    system = await pul.actor_system(addr=f"127.0.0.1:{args['port']}")
    queue = await open_writer(
        system,
        args["topic"],
        storage_root=args["root"],
        num_buckets=2,
        backend_options={"flush_interval_s": 0.1},
    )
    half = args["count"] // 2
    for i in range(half):
        await queue.put(record(i))
    Path(args["ready"]).write_text("ready")
    await wait_until_async(Path(args["joined"]).exists, "a reader joined")
    for i in range(half, args["count"]):
        await queue.put(record(i))
        await asyncio.sleep(0.01)  # real duration: the rest arrive one by one as it reads
    await wait_until_async(Path(args["done"]).exists, "the reader done")


async def pulsing_consumer(args: dict[str, Any]) -> None:
    """Join the producer's cluster and read until every record arrived (waiting for more)."""
    import pulsing as pul

    from persisting.queue import open_reader

    system = await pul.actor_system(
        addr=f"127.0.0.1:{args['port']}", seeds=[f"127.0.0.1:{args['seed_port']}"]
    )
    reader = None

    async def opened() -> bool:  # the producer's buckets may not be known here yet
        nonlocal reader
        with contextlib.suppress(Exception):
            reader = await open_reader(
                system, args["topic"], storage_root=args["root"], num_buckets=2
            )
        return reader is not None

    await wait_until_async(opened, "the topic opened through the producer's cluster")
    assert reader is not None
    got: list[dict[str, Any]] = []

    async def all_read() -> bool:
        assert reader is not None
        got.extend(await reader.get(limit=100, wait=True, timeout=0.5))
        Path(args["joined"]).write_text("joined")
        return len(got) >= args["count"]

    await wait_until_async(all_read, "every record")
    print(json.dumps([summary(r) for r in got]), flush=True)


async def direct_consumer(args: dict[str, Any]) -> None:
    """A QueueConsumer in its own process: read ``count`` records, commit, print them."""
    from persisting.queue import QueueConsumer

    consumer = QueueConsumer.open(
        args["root"], args["topic"], 0, args["name"], poll_interval_s=0.02
    )
    Path(args["ready"]).write_text("ready")
    got: list[tuple[int, dict[str, Any]]] = []

    async def all_read() -> bool:
        got.extend(await consumer.poll(100, wait=True, timeout=1))
        return len(got) >= args["count"]

    await wait_until_async(all_read, "every record")
    await consumer.commit()
    print(json.dumps([[offset, summary(r)] for offset, r in got]), flush=True)
    await consumer.close()


ROLES = {
    "writer": writer,
    "pulsing_writer": pulsing_writer,
    "pulsing_reader": pulsing_reader,
    "pulsing_producer": pulsing_producer,
    "pulsing_consumer": pulsing_consumer,
    "direct_consumer": direct_consumer,
}


if __name__ == "__main__":
    asyncio.run(ROLES[sys.argv[1]](json.loads(sys.argv[2])))
    sys.stdout.flush()
    os._exit(0)  # Pulsing's runtime may crash at interpreter exit after shutdown
