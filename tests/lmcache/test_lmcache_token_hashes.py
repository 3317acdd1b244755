"""TokenHasher(scheme="lmcache") gives LMCache's own keys, so Persisting finds by token ids
the chunks an LMCache engine stored through the plugin (lookup_tokens, prefetch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.token_database import ChunkedTokenDatabase

from persisting.config import PersistingSettings
from persisting.errors import ConfigError
from persisting.kv import TokenHasher, open_kv_store
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
from tests.timing import wait_until

pytestmark = pytest.mark.timeout(120)


def lmcache_keys(tokens: list[int], chunk: int, save_unfull: bool, **metadata) -> list[str]:  # type: ignore[no-untyped-def]
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk, save_unfull_chunk=save_unfull)
    database = ChunkedTokenDatabase(config, make_metadata(**metadata))
    return [k.to_string() for _s, _e, k in database.process_tokens(torch.tensor(tokens))]


def our_keys(tokens: list[int], chunk: int, save_unfull: bool, **hasher) -> list[str]:  # type: ignore[no-untyped-def]
    ours = TokenHasher(
        MODEL, chunk_size=chunk, save_unfull_chunk=save_unfull, scheme="lmcache", **hasher
    )
    return [str(k) for _s, _e, k in ours.process_tokens(tokens)]


def test_arange_600_gives_lmcache_s_keys() -> None:
    tokens = list(range(600))
    want = lmcache_keys(tokens, 256, False)
    assert [k.split("@")[3] for k in want] == ["2b763dd00afa89c8", "79e62c807b48385b"]
    assert our_keys(tokens, 256, False) == want
    assert our_keys(tokens, 256, True) == lmcache_keys(tokens, 256, True)  # + the tail chunk


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=300),
    chunk=st.sampled_from([1, 7, 16, 256]),
    save_unfull=st.booleans(),
    world=st.sampled_from([(1, 0), (4, 3)]),
    dtype=st.sampled_from([(torch.bfloat16, "bfloat16"), (torch.float16, "half")]),
)
def test_any_tokens_give_lmcache_s_keys(tokens, chunk, save_unfull, world, dtype) -> None:  # type: ignore[no-untyped-def]
    (world_size, worker), (torch_dtype, name) = world, dtype
    want = lmcache_keys(
        tokens, chunk, save_unfull, world_size=world_size, worker_id=worker, dtype=torch_dtype
    )
    got = our_keys(tokens, chunk, save_unfull, world_size=world_size, worker_id=worker, dtype=name)
    assert got == want


def test_chunks_an_engine_stored_are_found_and_prewarmed_by_token_ids(root: Path) -> None:
    layers, hidden = KV_SHAPE[0], KV_SHAPE[3] * KV_SHAPE[4]
    tokens = torch.arange(500, 500 + 4 * CHUNK + 5)  # four whole chunks and a tail
    kv = payload(11, (layers, 2, len(tokens), hidden), torch.bfloat16)
    slots = torch.arange(len(tokens))
    with cache_engine(make_config(root), make_metadata(), CPUConnector(kv.clone())) as engine:
        engine.store(tokens, slot_mapping=slots)
        wait_until(lambda: engine.lookup(tokens) == 4 * CHUNK, "stores")
        plugin_of(engine.storage_manager).flush()
    lmcache = TokenHasher(MODEL, chunk_size=CHUNK, scheme="lmcache")
    with open_kv_store(root, MODEL, memory_bytes=1 << 24) as store:
        assert store.lookup_tokens(tokens.tolist(), hasher=lmcache) == 4 * CHUNK
        assert store.lookup_tokens(tokens.tolist()) == 0  # Persisting's own scheme differs
        keys = [k for _s, _e, k in lmcache.process_tokens(tokens.tolist())]
        assert store.prefetch(keys) == 4  # prewarmed: all four now in the memory tier
        assert all(store.in_memory(k) for k in keys)
    # A store configured with LMCache's scheme hashes that way without being told.
    settings = PersistingSettings(kv={"hash_scheme": "lmcache", "chunk_size": CHUNK})
    with open_kv_store(root, MODEL, memory_bytes=0, settings=settings) as store:
        assert store.hash_scheme == "lmcache"
        assert store.lookup_tokens(tokens.tolist()) == 4 * CHUNK


def test_a_hash_scheme_setting_that_does_not_exist_is_a_config_error(root: Path) -> None:
    with pytest.raises(ConfigError, match="hash_scheme"):
        PersistingSettings(kv={"hash_scheme": "sha256_cbor"})
    with pytest.raises(ConfigError, match="hash_scheme"):
        open_kv_store(root, MODEL, memory_bytes=0, hash_scheme="sha256_cbor")
