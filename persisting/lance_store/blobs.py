"""Blob columns: payload bytes stored by Lance's blob encoding v2, or by reference.

A blob column may hold bytes Lance writes itself (``.blob`` files beside the fragment) or
references to byte ranges of files the caller wrote (``Blob.from_uri``). Hot-path readers
read the referenced file directly with a positioned read, skipping Lance's per-call
overhead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
from lance.blob import Blob, blob_array
from lance.blob import blob_field as _lance_blob_field


def blob_field(name: str, *, nullable: bool = True) -> pa.Field:
    """A schema field stored with Lance blob encoding v2."""
    return _lance_blob_field(name, nullable=nullable)


def blob_references(
    paths: Sequence[str | os.PathLike[str]], positions: Sequence[int], sizes: Sequence[int]
) -> pa.ExtensionArray:
    """A blob array referencing ``sizes[i]`` bytes at ``positions[i]`` of ``paths[i]``."""
    return blob_array(
        [
            Blob.from_uri(Path(p).absolute().as_uri(), position=int(pos), size=int(size))
            for p, pos, size in zip(paths, positions, sizes, strict=True)
        ]
    )


def blob_values(values: Sequence[bytes | None]) -> pa.ExtensionArray:
    """A blob array holding the given bytes inline (Lance stores them)."""
    return blob_array(list(values))


__all__ = ["blob_field", "blob_references", "blob_values"]
