"""Shared test data for the KV tests: keys and deterministic tensors."""

from __future__ import annotations

import torch

from persisting.kv import ChunkKey

MODEL = "meta-llama/Llama-3-8B"


def key(i: int, *, worker: int = 0, world: int = 1, model: str = MODEL) -> ChunkKey:
    return ChunkKey(model, world, worker, i * 7919 - 50_000, "bfloat16")


def tensor(seed: int, tokens: int = 16, hidden: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, tokens, hidden, generator=g).to(torch.bfloat16)
