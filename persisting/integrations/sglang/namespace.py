"""The namespace an SGLang server's pages live in, and the key of each page.

A page's bytes are meaningful only to a server that lays KV out exactly as the writer did:
the same weights (``model_identity``), page size, dtype, host layout (page-first or
layer-first: the bytes of a page are in another order), pool kind and geometry (layers,
heads, head sizes), and the same tensor-parallel split unless the KV is replicated across
ranks (MLA), pipeline and context-parallel sizes. All of that goes into a digest in the
namespace's name, so a server configured differently opens another directory and finds
nothing there: a miss, never bytes read as the wrong KV. Which shard a page is (the TP
rank unless MLA, the PP, CP and DCP ranks) goes into its key, so every rank of a server,
and every server of the same configuration, share one namespace and one disk budget, and
two servers of one model reuse each other's pages. Nothing here imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from persisting.integrations.common.namespace import KeyBuilder, weights_fields
from persisting.integrations.common.namespace import namespace_name as common_namespace

#: Bumped when the stored page format changes (it is part of every namespace digest).
PAGE_FORMAT = 1


@dataclass(frozen=True)
class Shard:
    """Which part of the model's KV one SGLang rank holds (from ``HiCacheStorageConfig``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    #: KV replicated across TP ranks (MLA): one copy serves every rank.
    replicated: bool = False
    #: Heads split finer than TP (``tp_lcm_size`` with a page-head layout).
    tp_lcm_size: int | None = None
    split_heads: bool = False

    def identity(self) -> dict[str, Any]:
        """The sizes that make pages of two servers incompatible (ranks are in the key)."""
        fields_: dict[str, Any] = {
            "pp_size": self.pp_size,
            "cp_size": self.cp_size,
            "dcp_size": self.dcp_size,
            "replicated": self.replicated,
        }
        if not self.replicated:
            fields_.update(tp_size=self.tp_size, tp_lcm_size=self.tp_lcm_size)
            fields_["split_heads"] = self.split_heads
        return fields_

    def key_parts(self) -> tuple[int, int, str]:
        """``(world size, worker id, tags)`` of this rank's keys."""
        world, worker = (1, 0) if self.replicated else (self.tp_size, self.tp_rank)
        tags = ""
        if self.pp_size > 1:
            tags += f"@pp%{self.pp_rank}"
        if self.cp_size > 1:
            tags += f"@cp%{self.cp_rank}"
        if self.dcp_size > 1:
            tags += f"@dcp%{self.dcp_rank}"
        return world, worker, tags


@dataclass(frozen=True)
class PageShape:
    """What a host pool's page is: the pool's kind and layout, tokens per page, dtype,
    the byte size of each part ``get_page_buffer_meta`` gives, and the pool's geometry."""

    pool: str
    layout: str
    page_size: int
    dtype: str
    part_bytes: tuple[int, ...]
    geometry: Mapping[str, int] = field(default_factory=dict)

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)


def namespace_name(
    model: str,
    weights: Mapping[str, str],
    shape: PageShape,
    shard: Shard,
    prefix: str | None = None,
) -> str:
    """``sglang.<prefix>.<digest>`` (:func:`~persisting.integrations.common.namespace.
    namespace_name`): the prefix (default: the model's last path part, made safe) says
    whose pages these are to a person reading ``persisting inspect``; the digest keeps
    incompatible KV apart."""
    fields_ = {
        "page_format": PAGE_FORMAT,
        "engine": "sglang",
        "model": model,
        **weights_fields(weights),
        **{k: v for k, v in asdict(shape).items() if k != "geometry"},
        **{f"pool_{k}": v for k, v in shape.geometry.items()},
        **shard.identity(),
    }
    return common_namespace("sglang", model, fields_, prefix)


class PageKeys(KeyBuilder):
    """Persisting keys of one rank's pages: LMCache's key shape with SGLang's page hash as
    the chunk hash, the TP size and rank as world size and worker id."""

    def __init__(self, namespace: str, shape: PageShape, shard: Shard):
        world, worker, tags = shard.key_parts()
        super().__init__(namespace, shape.dtype, world=world, worker=worker, tags=tags)

    def key(self, page_hash: str, pair: str | None = None) -> str:
        """The key of the page SGLang names ``page_hash`` (a SHA-256 hex digest; any other
        string is hashed into one, so every name SGLang uses maps to one valid key).
        ``pair`` tags a page moved by the interface pair the backend was not configured
        for (``"v1"`` or ``"flat"``): its bytes are laid out another way (the pool's parts
        end to end, or SGLang's flat data page), so it lives in a key space of its own."""
        return super().key(page_hash, f"@pair%{pair}" if pair else "")


__all__ = ["PAGE_FORMAT", "PageKeys", "PageShape", "Shard", "namespace_name"]
