"""Chunks LMCache stored through either plugin are prewarmed by their token ids.

In-process plugin: ``persisting prewarm --tokens FILE --hash-scheme lmcache`` publishes an
event on the topic, the served actor's event consumer hashes the tokens as LMCache's
engine did and loads those chunks into its memory tier; a client's ``lookup_tokens`` uses
the servers' scheme too. L2 adapter: ``--hash-scheme lmcache-mp`` names the chunks
LMCache's multiprocess server stored (its own hasher and key expansion)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lmcache.v1.distributed.api import ipc_key_to_object_keys
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.token_hasher import TokenHasher as ServerTokenHasher

from actors.launch import free_loopback_port, start_service
from persisting.config import PersistingSettings
from persisting.kv import TokenHasher
from persisting.service import KVCacheClient
from tests.lmcache.l2_harness import LAYOUT, adapter_json, storage_manager, write_through_l1
from tests.lmcache.lmcache_harness import (
    CHUNK,
    KV_SHAPE,
    MODEL,
    CPUConnector,
    cache_engine,
    make_config,
    make_metadata,
    payload,
    plugin_of,
)
from tests.timing import wait_until, wait_until_async

pytestmark = pytest.mark.timeout(240)

PERSISTING = str(Path(sys.executable).with_name("persisting"))
REPO = Path(__file__).resolve().parents[2]


def engine_stores(root: Path, tokens: torch.Tensor) -> None:
    """A real LMCache engine stores ``tokens``' KV through the Persisting plugin."""
    layers, hidden = KV_SHAPE[0], KV_SHAPE[3] * KV_SHAPE[4]
    kv = payload(21, (layers, 2, len(tokens), hidden), torch.bfloat16)
    with cache_engine(make_config(root), make_metadata(), CPUConnector(kv.clone())) as engine:
        engine.store(tokens, slot_mapping=torch.arange(len(tokens)))
        wait_until(lambda: engine.lookup(tokens) == 4 * CHUNK, "stores")
        plugin_of(engine.storage_manager).flush()


def prewarm_cli(root: Path, tokens_file: Path, *extra: str, model: str = MODEL) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    args = ["--json", "--storage-path", str(root), "--tokens", str(tokens_file)]
    out = subprocess.run(
        [PERSISTING, "prewarm", model, *args, "--chunk-size", str(CHUNK), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


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
            await wait_until_async(
                lambda: consumer.counters["applied_prewarm"] == 1, "the prewarm event applied"
            )
            assert not any(store.in_memory(k) for k in keys)
            # LMCache's scheme names the chunks the engine stored: all four reach memory.
            published = prewarm_cli(root, tokens_file, "--hash-scheme", "lmcache")
            assert (published["published"], published["hash_scheme"]) == (1, "lmcache")
            await wait_until_async(  # counted once the prefetch is done
                lambda: consumer.counters["prewarmed_chunks"] == 4, "the prewarm counted"
            )
            assert all(store.in_memory(k) for k in keys)
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


def test_prewarm_by_token_ids_loads_what_lmcache_s_server_stored_through_the_l2_adapter(
    root: Path, tmp_path: Path
) -> None:
    chunk = LAYOUT.shapes[0][2]  # tokens per chunk of the harness's L1 layout
    assert chunk == CHUNK
    tokens = list(range(3000, 3000 + 3 * chunk + 5))  # three whole chunks and a tail
    # What LMCache's multiprocess server does with a store request: its hasher, its keys,
    # its storage manager writing through L1 into the adapter.
    hashes = ServerTokenHasher(chunk).compute_chunk_hashes(tokens)
    request = IPCCacheServerKey(MODEL, 1, 0, tuple(tokens), 0, len(tokens), "store-1")
    (keys,) = ipc_key_to_object_keys(request, hashes, [0])
    assert len(keys) == 3
    with storage_manager(adapter_json(root)) as manager:
        write_through_l1(manager, keys)
    tokens_file = tmp_path / "tokens.txt"
    tokens_file.write_text(" ".join(map(str, tokens)))
    settings = PersistingSettings(
        storage_path=root, models=["lmcache"], kv={"memory_bytes": 16 << 20}
    )
    mp = ("--hash-scheme", "lmcache-mp", "--lmcache-model", MODEL)

    async def scenario() -> None:
        addr = f"127.0.0.1:{free_loopback_port()}"
        running = await start_service(settings, models=["lmcache"], addr=addr)
        try:
            store = running.actor.handler.state.store("lmcache")
            texts = [text for text, _n in store.stored_keys()]
            assert len(texts) == 3 and not any(store.in_memory(t) for t in texts)
            published = prewarm_cli(root, tokens_file, *mp, model="lmcache")
            assert (published["published"], published["chunks"]) == (1, 3)
            consumer = running.consumer
            assert consumer is not None
            await wait_until_async(  # counted once the prefetch is done
                lambda: consumer.counters["prewarmed_chunks"] == 3, "the prewarm counted"
            )
            assert all(store.in_memory(t) for t in texts)
        finally:
            await running.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=200))


def test_lmcache_mp_prewarm_needs_its_model_and_whole_chunks(root: Path, tmp_path: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)  # an existing root: the checks are prewarm's
    tokens_file = tmp_path / "tokens.txt"
    tokens_file.write_text("1 2 3")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    base = [PERSISTING, "prewarm", "lmcache", "--storage-path", str(root)]
    base += ["--tokens", str(tokens_file), "--hash-scheme", "lmcache-mp"]
    for extra, message in (
        ([], "--lmcache-model"),
        (["--lmcache-model", MODEL, "--chunk-size", "16"], "no whole chunk"),
        (["--lmcache-model", MODEL, "--cache-salt", "a/b"], "cannot hash"),
    ):
        out = subprocess.run(
            base + extra, capture_output=True, text=True, timeout=120, env=env, cwd=REPO
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr
