"""The namespace a vLLM engine's blocks live in, and the keys of its blocks.

A block's bytes are meaningful only to an engine that lays KV out exactly as the writer
did: same weights, block size, hash of the token chain, cache dtype, parallel layout,
KV-cache groups and per-layer page sizes, and the same stored format (the connector's
rows of each layer, or a whole row of vLLM's CPU tier holding every rank's shard). All of
that goes into a digest in the namespace's name, so an engine configured differently opens
another directory and finds nothing there -- a miss, never bytes read as the wrong KV.
Nothing here imports vLLM (the config objects are read by attribute).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from persisting.integrations.common.namespace import digest
from persisting.integrations.common.namespace import namespace_name as common_namespace

#: Bumped when the stored block format changes (it is part of every namespace digest).
BLOCK_FORMAT = 1

#: vLLM's cache dtype names as key dtypes (LMCache's spelling, which Persisting keys use).
_KEY_DTYPES = {
    "float16": "half",
    "half": "half",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float": "float",
    "fp8": "fp8_e4m3fn",
    "fp8_e4m3": "fp8_e4m3fn",
    "fp8_e5m2": "fp8_e5m2",
}


def key_dtype(dtype: str) -> str:
    """The dtype part of a block's key (``uint8`` for a dtype keys have no name for: the
    namespace digest holds the exact dtype either way)."""
    return _KEY_DTYPES.get(dtype.removeprefix("torch."), "uint8")


def offloading_layout(config: Any) -> dict[str, Any]:
    """What vLLM's ``OffloadingConfig`` says about the KV's layout: the fields of every
    namespace of an engine (the weights, the stored format and the engine's own extras are
    added by the caller)."""
    parallel = config.parallel
    return {
        "dtype": str(config.model.dtype),
        "groups": [
            {"id": g.group_id, "tokens": g.tokens_per_block, "layers": list(g.layer_names)}
            for g in config.groups
        ],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "parallel": {
            "world_size": parallel.world_size,
            "tp": parallel.tp_size,
            "pp": parallel.pp_size,
            "pcp": parallel.pcp_size,
            "dcp": parallel.dcp_size,
        },
        "kv_cache_layout": config.kv_cache_layout,
        "replicated_layout": bool(config.replicated_layout),
        "canonical_layout": bool(config.canonical_layout),
    }


def layout_digest(fields: Mapping[str, Any]) -> str:
    """16 hex digits over ``fields`` (JSON, keys sorted) and :data:`BLOCK_FORMAT`."""
    return digest({"block_format": BLOCK_FORMAT, **fields})


def namespace_name(model: str, fields: Mapping[str, Any], prefix: str | None = None) -> str:
    """``vllm.<prefix>.<digest>`` (:func:`~persisting.integrations.common.namespace.
    namespace_name`): the prefix (default: the model's last path part, made safe) says
    whose blocks these are to a person reading ``persisting inspect``; the digest keeps
    incompatible layouts apart."""
    return common_namespace(
        "vllm", model, {"block_format": BLOCK_FORMAT, "model": model, **fields}, prefix
    )


def block_key(namespace: str, block_hash: bytes, group: int, dtype: str) -> str:
    """The Persisting key of one offloaded block: LMCache's key shape, with vLLM's block
    hash (all its bytes, as hex) as the chunk hash and the KV-cache group as a tag."""
    return f"{namespace}@1@0@{block_hash.hex()}@{dtype}@g%{group}"


def block_hash_of(key: str) -> tuple[bytes, int]:
    """``(block hash, group)`` back from :func:`block_key`'s string."""
    parts = key.split("@")
    return bytes.fromhex(parts[3]), int(parts[5].removeprefix("g%"))


__all__ = [
    "BLOCK_FORMAT",
    "block_hash_of",
    "block_key",
    "key_dtype",
    "namespace_name",
    "offloading_layout",
]
