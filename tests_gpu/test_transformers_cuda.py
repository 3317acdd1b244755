"""The transformers bridge with a model and its cache on a CUDA device."""

from __future__ import annotations

from pathlib import Path

import torch

from persisting.cuda import shared_copier
from persisting.integrations.transformers import forward, load_prefix, save_prefix
from persisting.kv import open_kv_store
from tests.integrations.hf_helpers import CHUNK, KV_HEADS, MODEL, prompt, tiny_llama


def test_a_cuda_cache_round_trips_through_pinned_staging_bit_exact(root: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = tiny_llama(torch.bfloat16).to(device)
    ids = prompt(600, seed=11).to(device)
    copier = shared_copier(device)
    assert copier.staging is not None and copier.staging.pinned
    with (
        torch.inference_mode(),
        open_kv_store(
            root, MODEL, memory_bytes=64 << 20, disk_bytes=256 << 20, chunk_size=CHUNK
        ) as store,
    ):
        _, original = forward(model, ids[:, :512])
        assert save_prefix(store, ids[:, :512], original) == 512
        expected, _ = forward(model, ids[:, 512:], original)
        n, restored = load_prefix(
            store, ids, num_kv_heads=KV_HEADS, dtype=torch.bfloat16, device=device
        )
        assert n == 512 and restored.layers[0].keys.device == device
        got, _ = forward(model, ids[:, n:], restored)
    assert torch.equal(got, expected)
    assert copier.counters["pageable_bytes"] == 0 and copier.counters["d2h_bytes"] > 0
