"""A tiny random-weight Llama built from a config (no weights downloaded) and its prompts."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

MODEL = "tiny/llama"
CHUNK = 64
KV_HEADS = 2
VOCAB = 256


def tiny_llama(
    dtype: torch.dtype = torch.float32, seed: int = 0, kv_heads: int = KV_HEADS, layers: int = 3
) -> Any:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def prompt(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=g)
