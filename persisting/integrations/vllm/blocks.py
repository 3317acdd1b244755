"""A vLLM block's bytes in the engine's KV caches, and moving them to and from a file.

vLLM's offloading API hands a worker its KV caches as int8 tensors of
``[num_blocks, page_bytes]``, one per cache tensor (usually one per layer). One offloaded
block is the block's row of every tensor; Persisting stores them end to end as one value.

A load is the lean path the TTFT of a restored prompt depends on: one ``preadv`` per block
straight from the payload file into the block's rows of every tensor (no staging buffer,
no copy after the read), then the xxh3-64 of those rows checked against the stored
checksum. A store gathers the rows into one buffer (stores run behind the engine).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from persisting.errors import CorruptValueError, StorageIOError


@dataclass(frozen=True)
class BlockPages:
    """Where each block's bytes are: a row of each cache tensor, its first ``page_bytes``.

    ``tensors`` are numpy views of vLLM's tensors (they share its memory): a write into a
    view is a write into the engine's KV cache.
    """

    tensors: tuple[np.ndarray, ...]
    page_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tensors) != len(self.page_bytes) or not self.tensors:
            raise ValueError("one page size per cache tensor, and at least one tensor")
        for tensor, size in zip(self.tensors, self.page_bytes, strict=True):
            if tensor.ndim != 2 or tensor.itemsize != 1 or tensor.strides[1] != 1:
                raise ValueError("cache tensors must be byte views of [num_blocks, page]")
            if size > tensor.shape[1]:
                raise ValueError(f"page of {size} bytes in rows of {tensor.shape[1]}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block."""
        return sum(self.page_bytes)

    @property
    def num_blocks(self) -> int:
        return min(t.shape[0] for t in self.tensors)

    @property
    def shape(self) -> tuple[int, ...]:
        """The stored value's shape: ``[tensors, page]`` when all pages are equal."""
        if len(set(self.page_bytes)) == 1:
            return (len(self.page_bytes), self.page_bytes[0])
        return (self.block_bytes,)

    def rows(self, block_id: int) -> list[memoryview]:
        """The block's bytes, one writable view per tensor, in stored order."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside the KV cache's {self.num_blocks}")
        return [
            tensor[block_id, :size].data
            for tensor, size in zip(self.tensors, self.page_bytes, strict=True)
        ]

    def gather(self, block_id: int) -> np.ndarray:
        """A copy of the block's bytes, shaped :attr:`shape` (what a store writes)."""
        out = np.empty(self.block_bytes, dtype=np.uint8)
        at = 0
        for row in self.rows(block_id):
            out[at : at + len(row)] = np.frombuffer(row, dtype=np.uint8)
            at += len(row)
        return out.reshape(self.shape)

    def scatter(self, block_id: int, value: np.ndarray) -> None:
        """Copy a stored block (a memory-tier hit) into the block's rows."""
        flat = np.asarray(value, dtype=np.uint8).reshape(-1)
        if flat.size != self.block_bytes:
            raise CorruptValueError(f"block of {flat.size} bytes, {self.block_bytes} expected")
        at = 0
        for row in self.rows(block_id):
            np.frombuffer(row, dtype=np.uint8)[:] = flat[at : at + len(row)]
            at += len(row)


def read_rows(path: str, offset: int, rows: Sequence[memoryview], checksum: int) -> int:
    """Fill ``rows`` with the file's bytes from ``offset`` on, in one positioned vectored
    read (more only if the kernel returns it short), and check their xxh3-64.

    Returns the bytes read. Raises CorruptValueError for a file too short or a checksum
    that differs (the rows then hold the bad bytes: the caller must not use them), and
    StorageIOError for an I/O error; FileNotFoundError passes through (evicted meanwhile).
    """
    want = sum(len(r) for r in rows)
    pending = [r.cast("B") for r in rows]
    done = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while pending:
            got = os.preadv(fd, pending, offset + done)
            if got == 0:
                raise CorruptValueError(f"{path}: {done} of {want} bytes, then end of file")
            done += got
            while pending and got >= len(pending[0]):
                got -= len(pending[0])
                pending.pop(0)
            if pending and got:
                pending[0] = pending[0][got:]
    except OSError as exc:
        raise StorageIOError(f"reading {path}: {exc}") from exc
    finally:
        os.close(fd)
    digest = xxhash.xxh3_64()
    for row in rows:
        digest.update(row)
    if digest.intdigest() != checksum:
        raise CorruptValueError(f"{path}: checksum mismatch")
    return want


__all__ = ["BlockPages", "read_rows"]
