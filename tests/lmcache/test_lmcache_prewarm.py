"""Chunks an LMCache engine stored through the plugin are prewarmed by their token ids:
``persisting prewarm --tokens FILE --hash-scheme lmcache`` publishes an event on the topic,
the served actor's event consumer hashes the tokens as LMCache did and loads those chunks
into its memory tier; a client's ``lookup_tokens`` uses the servers' scheme too."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lmcache_harness import (
    CHUNK,
    KV_SHAPE,
    MODEL,
    CPUConnector,
    cache_engine,
    make_config,
    make_metadata,
    payload,
    plugin_of,
    wait_until,
)

from persisting.actors.launch import free_loopback_port, start_service
from persisting.config import PersistingSettings
from persisting.kv import TokenHasher
from persisting.service import KVCacheClient

pytestmark = pytest.mark.timeout(240)

PERSISTING = str(Path(sys.executable).with_name("persisting"))
REPO = Path(__file__).resolve().parents[2]


def engine_stores(root: Path, tokens: torch.Tensor) -> None:
    """A real LMCache engine stores ``tokens``' KV through the Persisting plugin."""
    layers, hidden = KV_SHAPE[0], KV_SHAPE[3] * KV_SHAPE[4]
    kv = payload(21, (layers, 2, len(tokens), hidden), torch.bfloat16)
    with cache_engine(make_config(root), make_metadata(), CPUConnector(kv.clone())) as engine:
        engine.store(tokens, slot_mapping=torch.arange(len(tokens)))
        wait_until(lambda: engine.lookup(tokens) == 4 * CHUNK, what="stores")
        plugin_of(engine.storage_manager).flush()


def prewarm_cli(root: Path, tokens_file: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    args = ["--json", "--storage-path", str(root), "--tokens", str(tokens_file)]
    out = subprocess.run(
        [PERSISTING, "prewarm", MODEL, *args, "--chunk-size", str(CHUNK), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


async def until(probe, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            pytest.fail("the prewarm event was not applied in time")
        await asyncio.sleep(0.1)


def test_prewarm_by_token_ids_loads_what_lmcache_stored_into_memory(
    root: Path, tmp_path: Path
) -> None:
    tokens = torch.arange(900, 900 + 4 * CHUNK + 3)  # four whole chunks and a tail
    engine_stores(root, tokens)
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(tokens.tolist()))
    lmcache = TokenHasher(MODEL, chunk_size=CHUNK, scheme="lmcache")
    keys = [key for _s, _e, key in lmcache.process_tokens(tokens.tolist())]
    assert len(keys) == 4
    settings = PersistingSettings(
        storage_path=root,
        models=[MODEL],
        kv={"memory_bytes": 16 << 20, "chunk_size": CHUNK, "hash_scheme": "lmcache"},
    )

    async def scenario() -> None:
        addr = f"127.0.0.1:{free_loopback_port()}"
        running = await start_service(settings, models=[MODEL], addr=addr)
        client = None
        try:
            store = running.actor.handler.state.store(MODEL)
            assert not any(store.in_memory(k) for k in keys)
            consumer = running.consumer
            assert consumer is not None
            # Persisting's own scheme names other chunks: applied, but nothing is loaded.
            published = prewarm_cli(root, tokens_file, "--hash-scheme", "persisting")
            assert published["hash_scheme"] == "persisting"
            await until(lambda: consumer.counters["applied_prewarm"] == 1)
            assert not any(store.in_memory(k) for k in keys)
            # LMCache's scheme names the chunks the engine stored: all four reach memory.
            published = prewarm_cli(root, tokens_file, "--hash-scheme", "lmcache")
            assert (published["published"], published["hash_scheme"]) == (1, "lmcache")
            await until(lambda: all(store.in_memory(k) for k in keys))
            assert consumer.counters["prewarmed_chunks"] == 4
            # A client hashes (and the server looks up) with the servers' scheme.
            client = await KVCacheClient.connect(name=running.name, model=MODEL, settings=settings)
            assert client.hash_scheme == "lmcache"
            assert await client.lookup_tokens(tokens.tolist()) == 4 * CHUNK
            persisting = TokenHasher(MODEL, chunk_size=CHUNK)
            assert await client.lookup_tokens(tokens.tolist(), hasher=persisting) == 0
        finally:
            if client is not None:
                await client.close()
            await running.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=200))
