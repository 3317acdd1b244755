"""Model shapes and GPUs the planner knows by name, and what one token of KV cache weighs.

Shapes are the published configurations (``config.json`` of each model on the Hugging Face
hub): layers, KV heads, head dimension, query heads and active parameters. GPU figures are
the vendors' dense BF16 peaks (no sparsity). They are inputs to arithmetic, not measurements:
the planner says so wherever it uses them.

How a token's KV is laid out decides what a tier stores:

* **GQA/MHA** keeps K and V per KV head: ``2 x layers x kv_heads x head_dim x dtype`` bytes.
  Tensor parallelism splits the heads, and each rank saves its share as one object. With
  more ranks than KV heads, engines replicate heads, and every rank still saves its copy.
* **MLA** (DeepSeek-V2/V3) keeps one latent vector per layer for all heads:
  ``layers x (kv_lora_rank + rope dim) x dtype`` bytes, neither K/V-doubled nor split by
  TP. Every rank holds the same latent, and LMCache saves it from the first rank only
  (``save_only_first_rank`` defaults to true for MLA), so one object per chunk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from persisting.errors import ConfigError

#: Bytes per element of the KV cache dtypes engines use (aliases map to the same size).
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: Head dimensions of real attention layers; anything else earns a warning.
USUAL_HEAD_DIMS = frozenset({32, 48, 64, 80, 96, 112, 128, 160, 192, 256})


def dtype_bytes(dtype: str) -> int:
    """Element size of a KV dtype name such as ``bf16`` or ``float8_e4m3fn``."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ConfigError(f"unknown dtype {dtype!r}; known: {known}").about("dtype")
    return DTYPE_BYTES[key]


def kv_bytes_per_token(
    layers: int, kv_heads: int, head_dim: int, dtype: str, *, mla: bool = False
) -> int:
    """Bytes one token's KV takes across all layers, one copy: ``2 x L x H x D x dtype``
    for K and V per head, or ``L x D x dtype`` for an MLA latent (``kv_heads`` is 1)."""
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}").about(name)
    if mla:
        return layers * head_dim * dtype_bytes(dtype)
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV shape and the figures a prefill estimate needs."""

    name: str
    hf_id: str
    layers: int
    #: KV heads (GQA groups); 1 for MLA, whose latent serves every head.
    kv_heads: int
    #: Per KV head; for MLA the latent width (kv_lora_rank + rope dimensions).
    head_dim: int
    attention: Literal["gqa", "mla"]
    #: Parameters used per token (all of them for dense models, the routed share for MoE).
    active_params: int
    q_heads: int
    #: Per query head, the widths of Q.K and of the values (what attention costs per token).
    qk_head_dim: int
    v_head_dim: int
    dtype: str = "bf16"

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gqa(name: str, hf_id: str, layers: int, kv: int, q: int, params: float) -> ModelPreset:
    return ModelPreset(name, hf_id, layers, kv, 128, "gqa", round(params * 1e9), q, 128, 128)


#: Models by the names ``persisting plan --model`` takes (a Hugging Face id works too).
MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _gqa("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 32, 8, 32, 8.03),
        _gqa("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 8, 32, 8.03),
        _gqa("llama-3-70b", "meta-llama/Meta-Llama-3-70B", 80, 8, 64, 70.6),
        _gqa("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8, 64, 70.6),
        _gqa("qwen2.5-7b", "Qwen/Qwen2.5-7B", 28, 4, 28, 7.62),
        _gqa("qwen2.5-32b", "Qwen/Qwen2.5-32B", 64, 8, 40, 32.8),
        _gqa("qwen2.5-72b", "Qwen/Qwen2.5-72B", 80, 8, 64, 72.7),
        _gqa("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 32, 8, 32, 12.9),
        _gqa("mixtral-8x22b", "mistralai/Mixtral-8x22B-v0.1", 56, 8, 48, 39.1),
        # MLA: kv_lora_rank 512 + qk_rope_head_dim 64 per layer; prefill attends with
        # 128 heads of 192 (128 nope + 64 rope) for Q.K and 128 for V; 37B active of 671B.
        ModelPreset(
            name="deepseek-v3",
            hf_id="deepseek-ai/DeepSeek-V3",
            layers=61,
            kv_heads=1,
            head_dim=576,
            attention="mla",
            active_params=37_000_000_000,
            q_heads=128,
            qk_head_dim=192,
            v_head_dim=128,
        ),
    )
}


@dataclass(frozen=True)
class GpuPreset:
    """An accelerator's dense BF16 peak, FLOP/s (the vendor's figure, without sparsity)."""

    name: str
    bf16_flops: int


GPU_PRESETS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("a100", 312 * 10**12),
        GpuPreset("l40s", 362 * 10**12),
        GpuPreset("h100", 989 * 10**12),
        GpuPreset("h200", 989 * 10**12),
        GpuPreset("mi300x", 1307 * 10**12),
        GpuPreset("b200", 2250 * 10**12),
    )
}


def find_preset(name: str) -> ModelPreset:
    """The preset named ``name`` (or whose Hugging Face id it is), case aside."""
    key = name.strip().lower()
    for preset in MODEL_PRESETS.values():
        if key in (preset.name, preset.hf_id.lower(), preset.hf_id.lower().split("/")[-1]):
            return preset
    raise ConfigError(
        f"unknown model {name!r}; presets: {', '.join(MODEL_PRESETS)} (or give the shape: "
        "layers, kv_heads, head_dim; or bytes_per_token)"
    ).about("model", "layers", "kv_heads", "head_dim", "bytes_per_token")


def find_gpu(name: str) -> GpuPreset:
    key = name.strip().lower()
    if key not in GPU_PRESETS:
        known = ", ".join(GPU_PRESETS)
        raise ConfigError(
            f"unknown gpu {name!r}; presets: {known} (or give prefill_tokens_per_s measured)"
        ).about("gpu", "prefill_tokens_per_s")
    return GPU_PRESETS[key]


def prefill_flops_per_token(preset: ModelPreset, prefix_tokens: int) -> int:
    """FLOPs to prefill one token of a ``prefix_tokens`` prompt, on average.

    ``2 x active parameters`` for the matrix products, plus attention: a token at position
    ``p`` does ``2 x p x (qk + v width)`` per layer, which averages to
    ``layers x q_heads x (qk_head_dim + v_head_dim) x prefix_tokens`` over a causal prompt.
    """
    width = preset.q_heads * (preset.qk_head_dim + preset.v_head_dim)
    return 2 * preset.active_params + preset.layers * width * prefix_tokens


__all__ = [
    "DTYPE_BYTES",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "USUAL_HEAD_DIMS",
    "GpuPreset",
    "ModelPreset",
    "dtype_bytes",
    "find_gpu",
    "find_preset",
    "kv_bytes_per_token",
    "prefill_flops_per_token",
]
