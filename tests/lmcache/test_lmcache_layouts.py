"""Which stored layouts the plugin serves for a key (LayoutGuard), with LMCache's metadata."""

from __future__ import annotations

import torch
from lmcache.utils import LayerCacheEngineKey

from persisting.integrations.lmcache.compat import LayoutGuard
from persisting.kv import Layout
from tests.lmcache.lmcache_harness import key, make_metadata


def layout(shape: tuple[int, ...], dtype: str = "bfloat16", fmt: str = "KV_2LTD") -> Layout:
    n = 1
    for d in shape:
        n *= d
    return Layout(shape, dtype, fmt, n * (1 if dtype == "uint8" else 2))


def test_whole_chunks_must_have_the_engines_kv_size_layers_and_hidden_size() -> None:
    guard = LayoutGuard(make_metadata(kv_shape=(4, 2, 16, 2, 32)))  # [2, 4, T, 64]
    k = key(1)
    assert guard.accepts(k, layout((2, 4, 16, 64)))
    assert guard.accepts(k, layout((2, 4, 5, 64)))  # a last, partial chunk
    assert not guard.accepts(k, layout((2, 2, 16, 64)))  # fewer layers
    assert not guard.accepts(k, layout((2, 4, 16, 128)))  # other heads
    assert not guard.accepts(k, layout((2, 4, 16, 64), dtype="half"))  # key says bfloat16
    assert not guard.accepts(key(1, dtype=torch.float16), layout((2, 4, 16, 64)))
    assert not guard.accepts(k, layout((2, 4, 16, 64), fmt="NOT_LMCACHE"))


def test_mla_engines_check_their_own_format() -> None:
    md = make_metadata(kv_shape=(4, 1, 16, 1, 576))
    md.use_mla = True
    guard = LayoutGuard(md)
    k = key(2)
    assert guard.accepts(k, layout((1, 4, 16, 576), fmt="KV_MLA_FMT"))
    assert not guard.accepts(k, layout((1, 8, 16, 576), fmt="KV_MLA_FMT"))


def test_per_layer_binary_and_free_form_layouts_are_checked_on_dtype_only() -> None:
    guard = LayoutGuard(make_metadata())
    layer_key = LayerCacheEngineKey("meta-llama/Llama-3-8B", 1, 0, 5, torch.bfloat16, layer_id=3)
    assert guard.accepts(layer_key, layout((16, 2, 64), fmt="KV_T2D"))
    assert guard.accepts(key(3), layout((2, 16, 8, 128), fmt="KV_T2D"))  # LMCache's test blobs
    assert guard.accepts(key(3), layout((4096,), dtype="uint8", fmt="BINARY"))
    assert not guard.accepts(key(3), layout((2, 16, 8, 128), dtype="float", fmt="KV_T2D"))
    assert LayoutGuard(None).accepts(key(3), layout((2, 9, 9, 9)))  # no metadata: dtype only
