"""What a server sends from and receives into: a memory-tier value's own buffer
(``memory_payload``), and puts that keep a buffer from ``allocate`` instead of copying it
(``batched_put_owned``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.errors import InvalidValueError
from persisting.kv import ChunkKey, Layout, open_kv_store
from persisting.kv.layout import check_layout, checksum, encode_value

MODEL = "owned/model"


def key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, i, "bfloat16")


def value(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 64, 128, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("durability", ["sync", "async", "write_back"])
def test_an_owned_put_keeps_the_buffer_and_reads_back_bit_exact(
    tmp_path: Path, durability: str
) -> None:
    with open_kv_store(
        tmp_path / "root", MODEL, memory_bytes=16 << 20, disk_bytes=64 << 20, durability=durability
    ) as store:
        layouts, buffers, digests = [], [], []
        for i in range(3):
            layout, data = encode_value(value(i), "KV_2LTD")
            buffer = store.allocate(layout.nbytes)
            buffer[:] = np.frombuffer(data, np.uint8)  # as bytes land from a socket
            layouts.append(layout)
            buffers.append(buffer)
            digests.append(checksum(data))
        results = store.batched_put_owned([key(i) for i in range(3)], buffers, layouts, digests)
        assert [r.stored for r in results] == [True, True, True]
        for i in range(3):
            assert torch.equal(store.get(key(i)), value(i))
            held = store.memory_payload(key(i))
            assert held is not None and held.checksum == digests[i]
            assert np.shares_memory(held.buffer, buffers[i])  # kept, not copied
        store.flush()
        if durability != "write_back":
            location = store.lease(key(0), 5.0)  # on disk, under the checksum it was given
            assert location is not None and location.checksum == digests[0]
        again = store.batched_put_owned([key(0)], [buffers[0]], [layouts[0]], [digests[0]])
        assert not again[0].stored  # first writer wins, as for any put


def test_a_layout_that_does_not_describe_its_buffer_is_refused(tmp_path: Path) -> None:
    with open_kv_store(tmp_path / "root", MODEL, memory_bytes=16 << 20, disk_bytes=0) as store:
        layout, data = encode_value(value(1), "KV_2LTD")
        buffer = store.allocate(layout.nbytes)
        for wrong in (
            Layout(layout.shape, layout.dtype, layout.fmt, layout.nbytes - 2),  # size
            Layout((4, 2, 64, 128), layout.dtype, "KV_2LTD", layout.nbytes),  # K/V axis
            Layout(layout.shape, "no-such-dtype", layout.fmt, layout.nbytes),
        ):
            with pytest.raises(InvalidValueError):
                store.batched_put_owned([key(1)], [buffer], [wrong], [checksum(data)])
        assert not store.contains(key(1))


_VALUES = {
    "torch bf16": lambda: value(2),
    "torch float32 KV_T2D": lambda: torch.zeros(16, 2, 8, dtype=torch.float32),
    "numpy half": lambda: np.zeros((2, 3, 4, 5), np.float16),
    "bytes": lambda: b"\x01" * 96,
}


@pytest.mark.parametrize("name", sorted(_VALUES))
def test_check_layout_agrees_with_encoding_the_value(name: str) -> None:
    """A layout checked without building its value (as a remote put's is) passes exactly
    when it is the layout the value would be stored with, and each field that lies fails."""
    made = _VALUES[name]()
    fmt = {"bytes": "binary", "torch float32 KV_T2D": "KV_T2D"}.get(name, "KV_2LTD")
    layout, _data = encode_value(made, fmt)
    check_layout(layout)
    liars = [
        Layout(layout.shape, layout.dtype, layout.fmt, layout.nbytes + 2, layout.kind),
        Layout(layout.shape, "no-such-dtype", layout.fmt, layout.nbytes, layout.kind),
        Layout(layout.shape, layout.dtype, "no-such-format", layout.nbytes, layout.kind),
        Layout(layout.shape, layout.dtype, layout.fmt, layout.nbytes, "pickle"),  # type: ignore[arg-type]
    ]
    if layout.kind != "bytes":
        swapped = (layout.shape[1], layout.shape[0], *layout.shape[2:])  # the K/V axis moved
        liars.append(Layout(swapped, layout.dtype, layout.fmt, layout.nbytes, layout.kind))
    if layout.kind == "torch":  # a dtype numpy has no name for, claimed as numpy
        liars.append(Layout(layout.shape, "bfloat16", layout.fmt, layout.nbytes, "numpy"))
    for liar in liars:
        with pytest.raises(InvalidValueError):
            check_layout(liar)


def test_a_held_memory_payload_outlives_its_eviction(tmp_path: Path) -> None:
    with open_kv_store(tmp_path / "root", MODEL, memory_bytes=16 << 20, disk_bytes=0) as store:
        store.put(key(1), value(1))
        held = store.memory_payload(key(1))
        assert held is not None
        other = Layout((2, 4, 64, 64), "bfloat16", "KV_2LTD", held.layout.nbytes // 2)
        assert store.memory_payload(key(1), expect=other) is None  # a layout mismatch: a miss
        store.remove(key(1))
        for i in range(2, 40):  # churn: the freed pool pages go to other values
            store.put(key(i), value(i))
        # still the removed value's bytes: the reference kept its pages from reuse
        assert checksum(held.buffer) == held.checksum
        assert store.memory_payload(key(1)) is None
