"""One builder of the namespaces engines keep KV in, and of the keys in them.

A value's bytes are meaningful only to an engine that lays KV out exactly as the writer
did: the same weights (their identity), dtype, layout, parallel sizes, stored format and
salt. Every such field goes into a digest in the namespace's name, so an engine configured
differently opens another namespace and finds nothing there: a miss, never bytes read as
the wrong KV. Which shard a value is (the ranks) goes into its key instead, so every rank
of an engine, and every engine of one configuration, share one namespace.

``<engine>.<label>.<digest>``: the label (default: the model's last path part, made safe)
says whose values these are to a person reading ``persisting inspect``. Keys have
LMCache's shape, ``<namespace>@<world>@<worker>@<hash>@<dtype>[@tag%value...]``, so every
store and tool reads them. Nothing here imports an engine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from persisting.errors import InvalidKeyError
from persisting.kv.keys import key_dtype as _key_dtype

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_HEX = re.compile(r"[0-9a-f]{1,128}")


def namespace_label(model: str, prefix: str | None = None) -> str:
    """The readable part of a namespace: ``prefix``, else the model's last path part,
    made safe for a directory name (64 characters at most)."""
    label = prefix if prefix is not None else model.rstrip("/").rsplit("/", 1)[-1]
    return _UNSAFE.sub("-", label).strip("-")[:64] or "model"


def digest(fields: Mapping[str, Any]) -> str:
    """16 hex digits over ``fields`` (JSON, keys sorted, anything else as its str)."""
    text = json.dumps(dict(fields), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def namespace_name(
    engine: str, model: str, fields: Mapping[str, Any], prefix: str | None = None
) -> str:
    """``<engine>.<label>.<digest of fields>``; ``fields`` hold everything that makes two
    engines' KV incompatible (the stored format's version among them)."""
    return f"{engine}.{namespace_label(model, prefix)}.{digest(fields)}"


def weights_fields(weights: Mapping[str, str]) -> dict[str, str]:
    """The weights' identity (``model_identity``'s fields) as namespace fields."""
    return {f"weights_{name}": value for name, value in weights.items()}


def key_dtype(dtype: str) -> str:
    """The dtype part of a key (``uint8`` for a dtype keys have no name for: the namespace
    digest holds the exact dtype either way)."""
    try:
        return _key_dtype(str(dtype).removeprefix("torch."))
    except InvalidKeyError:
        return "uint8"


def hex_hash(name: str) -> str:
    """``name`` when it is a hex digest (what engines hash prefixes into), else the
    SHA-256 of it: every name an engine uses maps to one valid key."""
    text = str(name)
    if _HEX.fullmatch(text):
        return text
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class KeyBuilder:
    """The keys of one shard's values in a namespace."""

    def __init__(
        self, namespace: str, dtype: str, *, world: int = 1, worker: int = 0, tags: str = ""
    ):
        self.namespace = namespace
        self._head = f"{namespace}@{world}@{worker}@"
        self._tail = f"@{key_dtype(dtype)}{tags}"

    def key(self, name: str, tag: str = "") -> str:
        """The key of the value the engine calls ``name`` (``tag``: ``"@name%value"``
        parts of a key space of its own)."""
        return f"{self._head}{hex_hash(name)}{self._tail}{tag}"


__all__ = [
    "KeyBuilder",
    "digest",
    "hex_hash",
    "key_dtype",
    "namespace_label",
    "namespace_name",
    "weights_fields",
]
