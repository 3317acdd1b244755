"""The native KV API: keys from tokens, put/get, prefix lookups, pins, durability modes, stats.

Persisting used as a plain Python library, in one process, with no other service: a KV
store per model under one storage root (memory tier + Lance-indexed disk tier).

    .venv/bin/python examples/kv_native.py                      # a temporary root
    .venv/bin/python examples/kv_native.py --storage-path ./kv-demo

It takes a few seconds and prints what each step shows.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
from pathlib import Path

import torch

from persisting.kv import ChunkKey, Layout, PutResult, TokenHasher, open_kv_store

MODEL = "meta-llama/Llama-3-8B"  # a real model id: '/' is fine, it is encoded into one dir
CHUNK_TOKENS = 64  # tokens per chunk (engines use 256; small here to stay quick)
LAYERS, HIDDEN = 4, 128  # a toy model: each chunk is [2, 4, 64, 128] bf16 = 128 KiB
MiB = 1 << 20


def kv_chunk(seed: int) -> torch.Tensor:
    """One chunk of KV cache in LMCache's KV_2LTD layout: [K/V, layers, tokens, hidden]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, CHUNK_TOKENS, HIDDEN, generator=generator).to(torch.bfloat16)


def basics(root: Path) -> None:
    print("== keys, put, get, lookups (durability='sync': a put returns once fsynced)")
    # open_kv_store takes anything left unset from PersistingSettings (PERSISTING_* env/TOML).
    with open_kv_store(
        root, MODEL, memory_bytes=8 * MiB, disk_bytes=64 * MiB, chunk_size=CHUNK_TOKENS
    ) as store:
        # Keys are chained hashes of the token ids: chunk i's key depends on every token
        # before it, so two prompts share keys exactly as long as they share a prefix.
        hasher = TokenHasher(MODEL, chunk_size=CHUNK_TOKENS)
        prompt = torch.arange(4 * CHUNK_TOKENS) % 32000
        keys = [key for _start, _end, key in hasher.process_tokens(prompt)]
        print(f"4 chunks of {CHUNK_TOKENS} tokens; first key: {keys[0]}")

        values = [kv_chunk(i) for i in range(len(keys))]
        # chain=True records that each chunk's parent is the one before it (used by the
        # prefix-aware eviction policy to drop suffixes before their prefixes).
        results = store.batched_put(keys, values, chain=True)
        print(f"put -> tier={results[0].tier} durable={results[0].durable}")
        print(
            f"put of an existing key stores nothing: stored={store.put(keys[0], values[0]).stored}"
        )

        got = store.get(keys[2])
        print(f"get -> {tuple(got.shape)} {got.dtype}, bit-exact: {torch.equal(got, values[2])}")

        # How much of a new prompt is already cached: the longest hit prefix, in tokens.
        other = prompt.clone()
        other[2 * CHUNK_TOKENS + 5] += 1  # differs inside chunk 3: chunks 3 and 4 differ
        print(f"lookup_tokens(same prompt)  = {store.lookup_tokens(prompt)} tokens")
        print(f"lookup_tokens(other prompt) = {store.lookup_tokens(other)} tokens")
        # lookup_prefix counts leading chunks and stops at the first miss: a suffix whose
        # prefix is gone is worthless.
        store.remove(keys[1])
        print(f"after removing chunk 2, lookup_prefix(keys) = {store.lookup_prefix(keys)} chunk(s)")

        # A reader states the layout it needs; anything else is a miss, never a wrong load.
        wrong = Layout((2, LAYERS, CHUNK_TOKENS, HIDDEN), "half", "KV_2LTD", values[0].nbytes)
        print(f"get with another dtype expected -> {store.get(keys[0], expect=wrong)}")

        # Pins are counted; a pinned chunk survives eviction and non-forced removal.
        store.pin(keys[0])
        print(f"pinned chunk removed without force: {store.remove(keys[0], force=False)}")
        store.unpin(keys[0])
        print(f"after unpin, removed without force: {store.remove(keys[0], force=False)}")

        stats = store.stats()
        print(
            f"stats: memory_items={stats['memory_items']} disk_items={stats['disk_items']} "
            f"disk_bytes={stats['disk_bytes']} lookup_hit_tokens={stats['lookup_hit_tokens']}"
        )

    with open_kv_store(root, MODEL, memory_bytes=8 * MiB, disk_bytes=64 * MiB) as reopened:
        # A new store (or a new process) on the same root finds every chunk on disk.
        present = sum(reopened.contains(k) for k in keys)
        print(f"reopened: {present} of {len(keys)} chunks present")
        exact = torch.equal(reopened.get(keys[3]), values[3])
        stats = reopened.stats()
        print(
            f"get after reopen bit-exact: {exact} (disk hits: {stats.get('get_hit_disk', 0)}, "
            f"memory hits: {stats.get('get_hit_memory', 0)})"
        )


def first_chunk_key(model: str) -> ChunkKey:
    """The key of the first chunk of a fixed prompt, in ``model``'s namespace."""
    return TokenHasher(model, chunk_size=CHUNK_TOKENS).process_tokens(range(CHUNK_TOKENS))[0][2]


def durability_modes(root: Path) -> None:
    print("== durability modes: which tier a put completed in")
    value = kv_chunk(7)

    # write-behind ("async"): the put returns once the value is in memory; a background
    # writer fsyncs it and then calls on_complete (exists_in_put_tasks is true until then).
    done = threading.Event()
    completed: list[PutResult] = []

    def on_complete(result: PutResult) -> None:
        completed.append(result)
        done.set()

    with open_kv_store(
        root, "demo/write-behind", memory_bytes=8 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as store:
        result = store.put(first_chunk_key("demo/write-behind"), value, on_complete=on_complete)
        print(f"async: put -> tier={result.tier} durable={result.durable}")
        done.wait(timeout=30)
        print(f"async: on_complete -> tier={completed[0].tier} durable={completed[0].durable}")

    # write-back ("write_back"): the value stays in memory; it reaches disk only when the memory
    # tier evicts it, or when the store closes.
    with open_kv_store(
        root, "demo/write-back", memory_bytes=8 * MiB, disk_bytes=64 * MiB, durability="write_back"
    ) as store:
        result = store.put(first_chunk_key("demo/write-back"), value)
        print(f"write_back: put -> tier={result.tier} durable={result.durable}")
        print(f"write_back: disk_items before close = {store.stats()['disk_items']}")
    with open_kv_store(root, "demo/write-back", memory_bytes=8 * MiB, disk_bytes=64 * MiB) as again:
        print(f"write_back: reopened after close, disk_items = {again.stats()['disk_items']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", type=Path, help="storage root (default: a temp dir)")
    args = parser.parse_args()
    temporary = tempfile.TemporaryDirectory(prefix="persisting-example-")
    with contextlib.nullcontext(args.storage_path) if args.storage_path else temporary as tmp:
        root = Path(tmp)
        print(f"storage root: {root}")
        basics(root)
        durability_modes(root)
        print("kv_native: done")


if __name__ == "__main__":
    main()
