"""A queue-driven prewarm job: publish prewarm/evict events, the serving actor applies them.

A scheduler that knows which documents will be hot soon (or which are stale) does not call
the storage servers itself: it appends events to a durable Lance queue topic
(``<storage_path>/queue/kv-events/``), and the event consumer that runs beside each
``persisting serve`` applies them -- ``prewarm`` loads chunks from disk into the memory
tier, ``evict`` removes them. The producer needs only the storage root, no Pulsing.

    .venv/bin/python examples/prewarm_job.py                      # a temporary root
    .venv/bin/python examples/prewarm_job.py --storage-path ./prewarm-demo

The script (1) stores a document's chunks the way an engine did earlier (native API),
(2) starts ``persisting serve`` on that root (its memory tier starts empty), (3) publishes
a prewarm event by token ids and watches the chunks arrive in memory, (4) publishes an
evict event with ``persisting prewarm --evict`` and watches the lookup shrink.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from _server_process import persisting_command, persisting_serve

from actors.kv_events import publish_events
from persisting.config import PersistingSettings
from persisting.kv import TokenHasher, open_kv_store
from persisting.service import KVCacheClient
from persisting.service.events import prewarm_event

MODEL = "meta-llama/Llama-3-8B"
CHUNK_TOKENS = 64
MiB = 1 << 20
DOCUMENT = (torch.arange(4 * CHUNK_TOKENS) * 7 % 32000).tolist()  # a 4-chunk document prefix


def store_document(root: Path) -> list[str]:
    """What an engine did yesterday: the document's KV chunks, durable on disk."""
    hasher = TokenHasher(MODEL, chunk_size=CHUNK_TOKENS)
    keys = [key for _s, _e, key in hasher.process_tokens(DOCUMENT)]
    generator = torch.Generator().manual_seed(0)
    values = [
        torch.randn(2, 4, CHUNK_TOKENS, 128, generator=generator).to(torch.bfloat16) for _ in keys
    ]
    with open_kv_store(root, MODEL, memory_bytes=16 * MiB, disk_bytes=64 * MiB) as store:
        store.batched_put(keys, values, chain=True)
    print(f"stored the document: {len(keys)} chunks on disk")
    return [str(key) for key in keys]


async def until(probe: Callable[[], Awaitable[Any]], done: Callable[[Any], bool]) -> Any:
    """Poll ``probe`` until ``done(value)``: events are applied asynchronously."""
    deadline = time.monotonic() + 30
    while True:
        value = await probe()
        if done(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


async def run_job(root: Path, addr: str, keys: list[str]) -> None:
    # The job's settings: the same storage root (and event topic) as the server's.
    settings = PersistingSettings(storage_path=root)
    hasher = TokenHasher(MODEL, chunk_size=CHUNK_TOKENS)
    # A client only to watch the server's figures; the job itself never talks to it.
    client = await KVCacheClient.connect(seeds=[addr], model=MODEL, same_host=False)
    member = client.members[0]

    async def figures() -> dict[str, Any]:
        stats = (await client.stats())["members"][member]
        store, events = stats["stores"][MODEL], stats["events"]  # the consumer's counters
        return {
            "memory_items": store["memory_items"],
            "disk_items": store["disk_items"],
            "events_applied": events.get("applied", 0),
        }

    try:
        print(f"server before the job: {await figures()}")

        # Prewarm by token ids: the consumer hashes them with the hasher settings the event
        # carries (chunk size, world size, worker id, dtype) and prefetches those chunks.
        event = prewarm_event(MODEL, tokens=DOCUMENT, chunk_size=CHUNK_TOKENS)
        published = await publish_events(settings, [event])  # durable when it returns
        print(f"published {published} prewarm event (tokens of the document)")
        after = await until(figures, lambda f: f["events_applied"] == 1)
        print(f"server after the prewarm: {after}")

        # Evict the last chunk from the shell, as a cron job would: `persisting prewarm --evict`.
        command = [
            *persisting_command(),
            "prewarm",
            MODEL,
            "--evict",
            "--key",
            keys[-1],
            "--storage-path",
            str(root),
            "--json",
        ]
        print("running: persisting prewarm", MODEL, "--evict --key <last chunk's key> --json")
        out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
        published = json.loads(out.stdout)
        consumers = published.pop("consumers", [])  # who will apply it (pid, address)
        print(f"  -> {published}, applied by {len(consumers)} live consumer(s)")
        hit = await until(
            lambda: client.lookup_tokens(DOCUMENT, hasher), lambda n: n < len(DOCUMENT)
        )
        print(f"lookup of the document after the evict: {hit} of {len(DOCUMENT)} tokens")
        print(f"server at the end: {await until(figures, lambda f: f['events_applied'] == 2)}")
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", type=Path, help="storage root (default: a temp dir)")
    args = parser.parse_args()
    temporary = tempfile.TemporaryDirectory(prefix="persisting-example-")
    with contextlib.nullcontext(args.storage_path) if args.storage_path else temporary as tmp:
        root = Path(tmp).absolute()
        print(f"storage root: {root}")
        keys = store_document(root)
        settings_env = {"PERSISTING_KV__MEMORY_BYTES": str(64 * MiB)}
        with persisting_serve(root, MODEL, settings_env) as addr:
            asyncio.run(asyncio.wait_for(run_job(root, addr, keys), timeout=120))
    print("prewarm_job: done")
    sys.stdout.flush()
    os._exit(0)  # Pulsing 0.1.2 may crash at interpreter exit after a shutdown


if __name__ == "__main__":
    main()
