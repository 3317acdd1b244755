"""Claiming a model namespace for a serving role, for the layers that reach storage
through the KV store (the LMCache adapters, the engine integrations).

A serving role (an LMCache L2 adapter, a server) claims its namespace before it opens its
store, so a second one on a live root is refused naming the first; engine processes that
share a namespace through their own stores claim nothing (see
:mod:`persisting.lance_store.ownership`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from persisting.lance_store import StorageRoot
from persisting.lance_store.ownership import Holder, OwnerClaim


def claim_model(
    storage_path: str | os.PathLike[str],
    model: str,
    *,
    role: str,
    what: str,
    details: Mapping[str, Any] | None = None,
) -> OwnerClaim:
    """Claim ``model``'s namespace under ``storage_path`` (NamespaceOwnedError naming the
    holder while a live process holds it)."""
    return StorageRoot(storage_path).claim_model(model, role, what, dict(details or {}))


def model_owner(storage_path: str | os.PathLike[str], model: str) -> Holder | None:
    """Who claimed ``model``'s namespace (``live`` while it holds it), or None."""
    return StorageRoot(storage_path).model_owner(model)


__all__ = ["Holder", "OwnerClaim", "claim_model", "model_owner"]
