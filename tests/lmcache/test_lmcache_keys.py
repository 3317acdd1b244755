"""ChunkKey <-> CacheEngineKey round trips, against LMCache's own key classes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lmcache.utils import (
    STR_DTYPE_TO_TORCH_DTYPE,
    CacheEngineKey,
    LayerCacheEngineKey,
    parse_cache_key,
)

from persisting.integrations.lmcache.compat import cache_engine_key_of, chunk_key_of
from persisting.kv import ChunkKey, LayerChunkKey, parse_key

MODEL = "meta-llama/Llama-3-8B"


def test_negative_hash_and_tags_round_trip_both_ways() -> None:
    lm = CacheEngineKey(
        MODEL, 4, 3, -0x1F, torch.bfloat16, {"lmcache.tag.user": "alice", "lmcache.tag.lora": "x"}
    )
    text = lm.to_string()
    assert text == f"{MODEL}@4@3@-1f@bfloat16@user%alice@lora%x"
    ours = chunk_key_of(lm)
    assert ours == ChunkKey(MODEL, 4, 3, -0x1F, "bfloat16", (("user", "alice"), ("lora", "x")))
    assert str(ours) == text
    back = cache_engine_key_of(ours)
    assert type(back) is CacheEngineKey and back == lm and hash(back) == hash(lm)
    assert parse_cache_key(str(ours)) == lm


def test_layer_keys_stay_layer_keys() -> None:
    lm = LayerCacheEngineKey(
        MODEL, 2, 1, 2**63 - 1, torch.float16, {"lmcache.tag.t": "v"}, layer_id=27
    )
    ours = chunk_key_of(lm)
    assert isinstance(ours, LayerChunkKey) and ours.layer_id == 27 and ours.dtype == "half"
    assert str(ours) == lm.to_string() == f"{MODEL}@2@1@7fffffffffffffff@half@27@t%v"
    back = cache_engine_key_of(str(ours))
    assert type(back) is LayerCacheEngineKey and back == lm
    assert [str(chunk_key_of(k)) for k in lm.split_layers(3)] == [
        str(k) for k in ours.chunk().split_layers(3)
    ]


def test_every_lmcache_key_dtype_has_the_same_name_on_both_sides() -> None:
    for name, dtype in STR_DTYPE_TO_TORCH_DTYPE.items():
        lm = CacheEngineKey(MODEL, 1, 0, -(2**63), dtype)
        assert chunk_key_of(lm).dtype == name
        assert cache_engine_key_of(chunk_key_of(lm)) == lm


tag_text = st.text(
    alphabet=st.characters(blacklist_characters="@%", blacklist_categories=("Cs", "Cc")),
    min_size=1,
    max_size=8,
)


@given(
    world=st.integers(1, 64),
    data=st.data(),
    chunk_hash=st.integers(-(2**63), 2**63 - 1),
    dtype=st.sampled_from(sorted(STR_DTYPE_TO_TORCH_DTYPE)),
    tags=st.lists(st.tuples(tag_text, tag_text), max_size=3, unique_by=lambda t: t[0]),
    layer=st.one_of(st.none(), st.integers(0, 127)),
)
def test_any_lmcache_key_round_trips(world, data, chunk_hash, dtype, tags, layer) -> None:  # type: ignore[no-untyped-def]
    worker = data.draw(st.integers(0, world - 1))
    configs = {f"lmcache.tag.{k}": v for k, v in tags} or None
    args = (MODEL, world, worker, chunk_hash, STR_DTYPE_TO_TORCH_DTYPE[dtype], configs)
    lm = LayerCacheEngineKey(*args, layer_id=layer) if layer is not None else CacheEngineKey(*args)
    ours = chunk_key_of(lm)
    assert str(ours) == lm.to_string()
    assert parse_key(lm.to_string()) == ours
    assert cache_engine_key_of(ours) == lm


def test_globally_numbered_workers_round_trip() -> None:
    # LMCache does not require worker_id < world_size; neither does Persisting.
    lm = CacheEngineKey(MODEL, 2, 5, -1, torch.bfloat16)
    ours = chunk_key_of(lm)
    assert (ours.world_size, ours.worker_id) == (2, 5)
    assert cache_engine_key_of(ours) == lm


def test_keys_persisting_cannot_represent_are_refused_not_mangled() -> None:
    with pytest.raises(ValueError):  # the '@' shifts every field: no silent mangling
        chunk_key_of(CacheEngineKey("org@evil/model", 1, 0, 1, torch.bfloat16))
