"""The namespace a vLLM engine's blocks go to: everything that makes its KV incompatible.

Two engines share blocks only if they would compute the same KV for the same tokens and
lay it out the same way. So a namespace's digest covers:

- the weights: :func:`~persisting.kv.namespace.identity.model_identity` (a pinned
  ``model_version``, else a fingerprint of the model's files, cached), plus what vLLM
  changes about them at load: revision, quantization, the model dtype, config overrides
  (``hf_overrides``, another config path), the attention dtype;
- the KV's layout as vLLM's offloading config says it (cache dtype, KV-cache groups and
  block size, tokens per hash, bytes per block, parallel sizes, the cache layout, replicated
  and canonical layouts: :func:`~persisting.integrations.vllm.namespace.offloading_layout`);
- the block hash algorithm (another one names the same tokens otherwise), and vLLM 0.34's
  lookahead block hashes when they are on (the hash of a block then covers the tokens after
  it too: an engine that turns them on, or off, opens another namespace);
- the stored format: the connector's rows of each layer (CPU engines), or a whole row of
  vLLM's CPU tier with every rank's shard and its length (``PersistingTier``).

The same fields, in words, are the namespace's description ``persisting inspect`` shows.
vLLM's config is read by attribute: nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from persisting.integrations.vllm.namespace import namespace_name, offloading_layout
from persisting.integrations.vllm.settings import ConnectorSettings
from persisting.kv.namespace.identity import model_identity

#: The VllmConfig of the engine being built on this thread (set by PersistingConnector
#: around vLLM's construction of the offloading spec and its tiers).
_ENGINE = threading.local()

#: ModelConfig fields that change the weights an engine computes with, or their KV.
_MODEL_FIELDS = (
    "revision",
    "code_revision",
    "quantization",
    "dtype",
    "hf_overrides",
    "hf_config_path",
    "override_attention_dtype",
)


@contextlib.contextmanager
def building_engine(vllm_config: Any) -> Iterator[None]:
    """Make ``vllm_config`` the engine whose namespaces are worked out on this thread."""
    _ENGINE.config = vllm_config
    try:
        yield
    finally:
        _ENGINE.config = None


def current_engine() -> Any:
    """The VllmConfig set by :func:`building_engine` on this thread, or None."""
    return getattr(_ENGINE, "config", None)


def _plain(value: Any) -> Any:
    """A JSON-able, stable rendering of a config value (a callable by its name)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if callable(value):
        return f"callable:{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return str(value)


def engine_facts(vllm_config: Any) -> dict[str, Any]:
    """What the engine's config adds to the offloading config about its weights and hashes."""
    if vllm_config is None:
        return {}
    model = vllm_config.model_config
    facts: dict[str, Any] = {
        name: _plain(getattr(model, name, None))
        for name in _MODEL_FIELDS
        if getattr(model, name, None) not in (None, {}, "")
    }
    facts["hash_algorithm"] = vllm_config.cache_config.prefix_caching_hash_algo
    # vLLM 0.34's lookahead block hashes (EAGLE-like speculative decoding under a connector
    # that takes them, as the offloading connector does): each block's hash also covers the
    # tokens after it, so the same tokens are other blocks. Recorded only when on, so the
    # namespaces of engines without them stay where they were.
    lookahead = getattr(vllm_config, "num_hash_lookahead_tokens", 0)
    if isinstance(lookahead, int) and lookahead > 0:
        facts["hash_lookahead_tokens"] = lookahead
    return facts


def engine_namespace(
    config: Any, settings: ConnectorSettings, *, stored: str, vllm_config: Any = None, **extra: Any
) -> tuple[str, dict[str, Any]]:
    """The namespace's name for an engine with offloading config ``config``, and its
    description (what ``persisting inspect`` shows). ``stored``: the stored format;
    ``extra``: the format's own fields (the row length of a tier)."""
    vllm_config = vllm_config if vllm_config is not None else current_engine()
    facts = engine_facts(vllm_config)
    model = config.model.name
    weights = model_identity(model, revision=facts.get("revision"), version=settings.model_version)
    layout = offloading_layout(config)
    fields = {**layout, **facts, **weights, "stored": stored, **extra}
    name = namespace_name(model, fields, settings.namespace)
    describe = {
        "engine": "vllm",
        "model": model,
        "dtype": layout["dtype"],
        "block_size": [g["tokens"] for g in layout["groups"]],
        "layout": {"stored": stored, "kv_cache_layout": layout["kv_cache_layout"], **extra},
        "parallel": layout["parallel"],
        **weights,
        **{
            k: v
            for k, v in facts.items()
            if k in ("quantization", "hf_overrides", "hash_lookahead_tokens")
        },
    }
    return name, describe


__all__ = ["building_engine", "current_engine", "engine_facts", "engine_namespace"]
