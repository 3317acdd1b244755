"""The KV-cache service: `persisting serve` in one process, a KVCacheClient in another.

This script starts ``persisting serve`` as a child process on a free 127.0.0.1 port (the
server is configured through ``PERSISTING_*`` variables and flags), connects a client to
it, stores and reads chunks over the same-host fast path and over plain Pulsing messages,
then stops the server.

    .venv/bin/python examples/service_client.py                      # a temporary root
    .venv/bin/python examples/service_client.py --storage-path ./service-demo

It takes a few seconds. On a real deployment the server runs on each storage node and the
clients live in the engines or jobs: see docs/service.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch
from _server_process import persisting_serve  # starts and stops `persisting serve`

from persisting.kv import TokenHasher
from persisting.service import KVCacheClient

MODEL = "meta-llama/Llama-3-8B"
CHUNK_TOKENS = 64
MiB = 1 << 20


async def use_the_service(addr: str) -> None:
    hasher = TokenHasher(MODEL, chunk_size=CHUNK_TOKENS)
    tokens = torch.arange(4 * CHUNK_TOKENS) % 32000
    keys = [key for _s, _e, key in hasher.process_tokens(tokens)]
    generator = torch.Generator().manual_seed(0)
    values = [
        torch.randn(2, 4, CHUNK_TOKENS, 128, generator=generator).to(torch.bfloat16) for _ in keys
    ]

    # connect() starts Pulsing in this process, joined to the server through its address,
    # and finds the servers registered under the actor name ("kvstore" by default).
    client = await KVCacheClient.connect(seeds=[addr], name="kvstore", model=MODEL)
    try:
        member = client.members[0]
        print(f"connected to {member}; same-host fast path: {client.same_host(member)}")
        results = await client.batched_put(keys[:3], values[:3])
        print(f"put 3 chunks -> tier={results[0].tier} durable={results[0].durable}")
        got = await client.batched_get(keys)
        exact = all(torch.equal(g, v) for g, v in zip(got[:3], values[:3], strict=True))
        print(f"batched_get -> {sum(g is not None for g in got)} hits, 1 miss; bit-exact: {exact}")
        # lookup_tokens hashes on the client side: give it the hasher the chunks were keyed
        # with (by default it uses this process's settings.kv.chunk_size).
        hit = await client.lookup_tokens(tokens, hasher)
        print(f"lookup_tokens -> {hit} of {len(tokens)} tokens (the 4th chunk is missing)")

        # A client on another host uses Pulsing messages for the bytes; same_host=False forces
        # that path here. Same API, same answers.
        remote = await KVCacheClient.connect(model=MODEL, same_host=False)
        try:
            await remote.put(keys[3], values[3])
            value = await remote.get(keys[0])
            print(
                f"message-path client: same_host={remote.same_host(member)}, "
                f"get bit-exact: {torch.equal(value, values[0])}"
            )
        finally:
            await remote.close()
        print(f"lookup_tokens now -> {await client.lookup_tokens(tokens, hasher)} tokens")

        stats = await client.stats()
        store = stats["members"][member]["stores"][MODEL]
        service = stats["members"][member]["service"]
        print(
            f"server stats: memory_items={store['memory_items']} disk_items={store['disk_items']} "
            f"get_hits={service.get('get_hits', 0)} get_misses={service.get('get_misses', 0)}"
        )
    finally:
        await client.close()  # ends its sessions and, as it started Pulsing here, shuts it down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", type=Path, help="storage root (default: a temp dir)")
    args = parser.parse_args()
    temporary = tempfile.TemporaryDirectory(prefix="persisting-example-")
    with contextlib.nullcontext(args.storage_path) if args.storage_path else temporary as tmp:
        root = Path(tmp).absolute()
        print(f"storage root: {root}")
        # The server's settings, as PERSISTING_* variables (nested sections with __); its
        # command-line flags (storage path, model, address) win over them.
        settings_env = {
            "PERSISTING_KV__MEMORY_BYTES": str(64 * MiB),
            "PERSISTING_KV__DISK_BYTES": str(256 * MiB),
        }
        with persisting_serve(root, MODEL, settings_env) as addr:
            asyncio.run(asyncio.wait_for(use_the_service(addr), timeout=120))
    print("service_client: done")
    sys.stdout.flush()
    # Pulsing 0.1.2 may crash at interpreter exit after a shutdown: leave without exit hooks.
    os._exit(0)


if __name__ == "__main__":
    main()
