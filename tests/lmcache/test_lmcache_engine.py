"""The full LMCacheEngine cycle through the plugin: store -> lookup -> retrieve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lmcache.lmcache_harness import (
    CHUNK,
    KV_SHAPE,
    PLUGIN,
    CPUConnector,
    cache_engine,
    make_config,
    make_metadata,
    payload,
    plugin_of,
    same_bytes,
)
from tests.timing import wait_until

pytestmark = pytest.mark.timeout(120)

LAYERS, HIDDEN = KV_SHAPE[0], KV_SHAPE[3] * KV_SHAPE[4]


def paged_kv(tokens: int, seed: int) -> torch.Tensor:
    """The 'GPU' KV buffer: [layers, K/V, slots, hidden]."""
    return payload(seed, (LAYERS, 2, tokens, HIDDEN), torch.bfloat16)


def test_store_lookup_retrieve_round_trip_through_the_plugin(root: Path) -> None:
    tokens = torch.arange(1000, 1000 + 5 * CHUNK)
    slots = torch.randperm(5 * CHUNK)  # pages scattered over the buffer
    original = paged_kv(5 * CHUNK, seed=3)
    connector = CPUConnector(original.clone())
    with cache_engine(make_config(root), make_metadata(), connector) as engine:
        manager = engine.storage_manager
        plugin = plugin_of(manager)
        engine.store(tokens, slot_mapping=slots)
        keys = [k for _s, _e, k in engine.token_database.process_tokens(tokens)]
        wait_until(lambda: plugin.batched_contains(keys) == 5, "plugin puts")
        # Its put tasks have let go of LMCache's objects (contains is true from the moment
        # a value is in the plugin's memory tier): clear() then drops them all, and only
        # the plugin can serve the retrieve.
        plugin.wait_for_puts()
        manager.clear(locations=["LocalCPUBackend"])
        assert manager.batched_contains(keys)[1].keys() == {PLUGIN}
        assert engine.lookup(tokens) == 5 * CHUNK
        assert engine.lookup(torch.cat([tokens[: 2 * CHUNK], tokens[:CHUNK] + 7])) == 2 * CHUNK

        connector.kv.zero_()
        mask = engine.retrieve(tokens, slot_mapping=slots)
        assert bool(mask.all())
        assert same_bytes(connector.kv, original)

        # A prefix of another request whose third chunk differs: two chunks come back.
        other = tokens.clone()
        other[2 * CHUNK + 5] += 1
        connector.kv.zero_()
        mask = engine.retrieve(other, slot_mapping=slots)
        assert int(mask.sum()) == 2 * CHUNK
        head = slots[: 2 * CHUNK]
        assert same_bytes(connector.kv[:, :, head], original[:, :, head])
        assert plugin.stats()["stores"][engine.metadata.model_name]["corruptions"] == 0


def test_a_new_engine_on_the_same_root_finds_the_chunks(root: Path) -> None:
    tokens = torch.arange(7, 7 + 3 * CHUNK)
    slots = torch.arange(3 * CHUNK)
    original = paged_kv(3 * CHUNK, seed=4)
    metadata = make_metadata()
    with cache_engine(make_config(root), metadata, CPUConnector(original.clone())) as engine:
        engine.store(tokens, slot_mapping=slots)
    # The first engine is gone (its CPU tier with it); the plugin's chunks are not.
    connector = CPUConnector(torch.zeros_like(original))
    with cache_engine(make_config(root), metadata, connector) as engine:
        assert engine.lookup(tokens) == 3 * CHUNK
        assert bool(engine.retrieve(tokens, slot_mapping=slots).all())
        assert same_bytes(connector.kv, original)
