"""Each stored block's parent: the block before it in its request's token chain.

The prefix-aware eviction policy (``eviction="prefix"``) evicts a chain's later blocks
before its earlier ones, so a prompt longer than the budget keeps its first blocks -- the
ones every later request sharing the prefix needs. For that the store must know each
block's parent, across the engine steps and jobs a request's blocks are stored in, not
just within one batch. vLLM's scheduler records, per request, the token position each
offload key ends at (``ReqContext.set_offload_key_position``): the parent of the key ending
at token ``p`` is the request's key of the same KV-cache group ending at ``p - span``.
Nothing here imports vLLM (the request context is read by attribute).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: vLLM's offload key: the block hash, then the KV-cache group as 4 big-endian bytes.
_GROUP_BYTES = 4


def _group(key: bytes) -> int:
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


def chain_parents(
    keys: Sequence[bytes], req_context: Any, span: Callable[[int], int]
) -> list[bytes | None]:
    """The parent offload key of each of ``keys`` (None for a request's first block, or
    when vLLM recorded no position). ``span(group)``: tokens per offloaded chunk of that
    KV-cache group."""
    positions: Mapping[bytes, int] = getattr(req_context, "_offload_key_positions", None) or {}
    if not positions:
        return [None] * len(keys)
    by_end = {(_group(k), end): k for k, end in positions.items()}
    parents: list[bytes | None] = []
    for key in keys:
        end = positions.get(key)
        if end is None:
            parents.append(None)
            continue
        group = _group(key)
        parents.append(by_end.get((group, end - span(group))))
    return parents


__all__ = ["chain_parents"]
