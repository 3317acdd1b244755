"""Tensor layout metadata and the zero-pickle value codec.

A stored value is its raw bytes plus a :class:`Layout` (shape, dtype, memory format, byte
size, and the kind of array it was: torch, numpy or plain bytes). Reading a value back
rebuilds the same kind of array over a page-aligned buffer without copying again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import xxhash

from persisting.errors import InvalidValueError
from persisting.shm.pages import aligned_buffer, copy_bytes, loaded_torch

ValueKind = Literal["torch", "numpy", "bytes"]


class MemoryFormat(NamedTuple):
    """What a memory format says about a value's shape."""

    #: ``(ndim, axis that must have size 2)`` -- KV layouts carry K and V on one axis --
    #: or None: any shape is accepted.
    shape: tuple[int, int] | None
    #: The axis that counts tokens, or None (opaque bytes: a chunk counts as one token).
    token_axis: int | None


#: Memory formats (LMCache's names): each one's shape rule and token axis.
MEMORY_FORMATS: dict[str, MemoryFormat] = {
    "KV_2LTD": MemoryFormat((4, 0), 2),  # [2, layers, tokens, hidden]
    "KV_2TD": MemoryFormat((3, 0), 1),  # [2, tokens, hidden]
    "KV_T2D": MemoryFormat((3, 1), 0),  # [tokens, 2, hidden]
    "KV_MLA_FMT": MemoryFormat(None, 1),  # [layers, tokens, latent] (no K/V axis)
    "BINARY": MemoryFormat(None, None),
    "binary": MemoryFormat(None, None),
    # LMCache's other format names, so every LMCache MemoryFormat has a stored name.
    "UNDEFINED": MemoryFormat(None, None),
    "BINARY_BUFFER": MemoryFormat(None, None),
    "EC_TD": MemoryFormat(None, 0),  # encoder cache [tokens, hidden]
    "HS_TD": MemoryFormat(None, 0),  # hidden states [tokens, hidden]
}


def token_count(layout: Layout) -> int:
    """The tokens a value of ``layout`` holds: its format's token axis, else 1."""
    rule = MEMORY_FORMATS.get(layout.fmt)
    axis = None if rule is None else rule.token_axis
    tokens = layout.shape[axis] if axis is not None and len(layout.shape) > axis else 1
    return max(1, tokens)


#: Formats whose payload is opaque bytes: a key's dtype says nothing about them.
BYTE_FORMATS = frozenset({"BINARY", "binary", "BINARY_BUFFER"})

_TORCH_NAMES = {
    "float16": "half",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float64": "double",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
    "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
}


@functools.cache
def _torch_to_name() -> dict[Any, str]:
    import torch

    return {
        getattr(torch, attr): name for attr, name in _TORCH_NAMES.items() if hasattr(torch, attr)
    }


def dtype_name(dtype: Any) -> str:
    """The name a stored layout gives the torch dtype ``dtype`` (LMCache's names)."""
    try:
        return _torch_to_name()[dtype]
    except KeyError:
        raise InvalidValueError(f"unsupported tensor dtype {dtype}") from None


def torch_dtype(name: str) -> Any:
    """The torch dtype LMCache calls ``name`` (``half``, ``bfloat16``, ``float``...)."""
    for dtype, dtype_name in _torch_to_name().items():
        if dtype_name == name:
            return dtype
    raise InvalidValueError(f"no torch dtype is called {name!r}")


_NUMPY_TO_NAME: dict[np.dtype, str] = {
    np.dtype(np.float16): "half",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
    np.dtype(np.int8): "int8",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int16): "int16",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.bool_): "bool",
}
NAME_TO_NUMPY: dict[str, np.dtype] = {v: k for k, v in _NUMPY_TO_NAME.items()}


@dataclass(frozen=True, slots=True)
class Layout:
    """What a stored value looks like; a reader's expectation is compared against it."""

    shape: tuple[int, ...]
    dtype: str
    fmt: str
    nbytes: int
    kind: ValueKind = "torch"

    def matches(self, expected: Layout) -> bool:
        """True if a reader expecting ``expected`` may use this value (kind may differ)."""
        return (
            self.shape == tuple(expected.shape)
            and self.dtype == expected.dtype
            and self.fmt == expected.fmt
            and self.nbytes == expected.nbytes
        )

    @property
    def torch_dtype(self) -> Any:
        return torch_dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "fmt": self.fmt,
            "nbytes": self.nbytes,
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(
            tuple(int(x) for x in d["shape"]),
            d["dtype"],
            d["fmt"],
            int(d["nbytes"]),
            d.get("kind", "torch"),
        )

    @classmethod
    def of(cls, value: Any, fmt: str = "KV_2LTD") -> Layout:
        """The layout ``value`` would be stored with (validates it)."""
        return encode_value(value, fmt)[0]


@dataclass(frozen=True, slots=True)
class Gathered:
    """One ``binary`` value whose bytes lie in several host buffers, stored end to end: a
    paged engine's KV page spread over its K and V halves, or over its layers. A put writes
    it with vectored writes straight from those buffers (hashed as they go), never copying
    the parts into one buffer first. The buffers must not change until the put returns."""

    parts: tuple[memoryview, ...]

    def __post_init__(self) -> None:
        for part in self.parts:
            if not part.c_contiguous or part.format != "B" or part.ndim != 1:
                raise InvalidValueError("a gathered value's parts must be flat byte views")
        if self.nbytes == 0:
            raise InvalidValueError("zero-size values cannot be stored")

    @property
    def nbytes(self) -> int:
        return sum(len(part) for part in self.parts)

    def layout(self, fmt: str) -> Layout:
        """The layout it is stored with: plain bytes (``fmt`` must be ``binary``)."""
        if fmt not in ("binary", "BINARY"):
            raise InvalidValueError(f"gathered values need fmt='binary', not {fmt!r}")
        return Layout((self.nbytes,), "uint8", fmt, self.nbytes, "bytes")


#: The bytes of a value on its way to a tier: one buffer, or several stored end to end.
Payload = memoryview | Gathered


def payload_parts(payload: Payload) -> tuple[memoryview, ...]:
    """The byte views a payload's bytes are in, in stored order."""
    return payload.parts if isinstance(payload, Gathered) else (payload,)


def _check_format(fmt: object, shape: tuple[int, ...], check_shape: bool = True) -> str:
    if not isinstance(fmt, str) or fmt not in MEMORY_FORMATS:
        raise InvalidValueError(f"unknown memory format {fmt!r}; known: {sorted(MEMORY_FORMATS)}")
    rule = MEMORY_FORMATS[fmt].shape
    if rule is not None and check_shape:
        ndim, kv_axis = rule
        if len(shape) != ndim or shape[kv_axis] != 2:
            raise InvalidValueError(
                f"shape {list(shape)} does not fit format {fmt} "
                f"(want {ndim} dims with size 2 on axis {kv_axis})"
            )
    return fmt


def is_device_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor on a device other than the CPU (not ``meta``)."""
    torch = loaded_torch()
    return (
        torch is not None
        and isinstance(value, torch.Tensor)
        and value.device.type not in ("cpu", "meta")
    )


def tensor_layout(value: Any, fmt: str, *, check_shape: bool = True) -> Layout:
    """The layout a torch tensor (on any device) is stored with; validates it, copies
    nothing (a device tensor's bytes are moved by the caller)."""
    import torch

    if value.layout != torch.strided:
        raise InvalidValueError(f"{value.layout} tensors cannot be stored; make it dense")
    if value.device.type == "meta":
        raise InvalidValueError("a meta-device tensor has no data to store")
    names = _torch_to_name()
    if value.dtype not in names:
        raise InvalidValueError(f"unsupported tensor dtype {value.dtype}")
    shape = tuple(int(x) for x in value.shape)
    layout = Layout(
        shape,
        names[value.dtype],
        _check_format(fmt, shape, check_shape),
        value.numel() * value.element_size(),
        "torch",
    )
    if layout.nbytes == 0:
        raise InvalidValueError("zero-size values cannot be stored")
    return layout


def encode_value(value: Any, fmt: str, *, check_shape: bool = True) -> tuple[Layout, memoryview]:
    """Validate ``value`` and return its layout and a read-only byte view of its data.

    Non-contiguous tensors are made contiguous (one copy); contiguous ones are not copied.
    ``check_shape=False`` keeps the format name but skips its shape rule, for layouts that
    another system defines (LMCache's own tests and benchmarks label 4-D blobs KV_T2D).
    """
    torch = loaded_torch()
    if torch is not None and isinstance(value, torch.Tensor):
        layout = tensor_layout(value, fmt, check_shape=check_shape)
        if value.device.type != "cpu":
            value = value.to("cpu")  # KVStore copies device tensors down itself (pinned)
        tensor = value.detach().contiguous()
        raw = (
            tensor.reshape(-1).view(torch.uint8).numpy()
            if tensor.numel()
            else np.empty(0, np.uint8)
        )
        view = raw.data.cast("B")
    elif isinstance(value, np.ndarray):
        if value.dtype not in _NUMPY_TO_NAME:
            raise InvalidValueError(f"unsupported array dtype {value.dtype}")
        array = np.ascontiguousarray(value)
        shape = tuple(int(x) for x in array.shape)
        layout = Layout(
            shape,
            _NUMPY_TO_NAME[array.dtype],
            _check_format(fmt, shape, check_shape),
            int(array.nbytes),
            "numpy",
        )
        view = array.reshape(-1).view(np.uint8).data.cast("B")
    elif isinstance(value, bytes | bytearray | memoryview):
        view = memoryview(value)
        if not view.c_contiguous:
            raise InvalidValueError("a strided (non-contiguous) memoryview cannot be stored")
        view = view.cast("B")
        if fmt not in ("binary", "BINARY"):
            raise InvalidValueError(f"bytes values need fmt='binary', not {fmt!r}")
        layout = Layout((len(view),), "uint8", fmt, len(view), "bytes")
    else:
        raise InvalidValueError(
            f"values must be torch.Tensor, numpy.ndarray or bytes, not {type(value).__name__}"
        )
    if layout.nbytes == 0:
        raise InvalidValueError("zero-size values cannot be stored")
    return layout, view


def writable_bytes(out: Any) -> memoryview:
    """A flat writable byte view of a caller's destination buffer (a contiguous CPU tensor,
    a numpy array, a bytearray...): what ``get_into`` fills."""
    torch = loaded_torch()
    if torch is not None and isinstance(out, torch.Tensor):
        if not out.is_contiguous() or out.device.type != "cpu":
            raise InvalidValueError("get_into needs a contiguous CPU tensor")
        out = out.view(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(out)
    except TypeError as exc:
        raise InvalidValueError(f"get_into needs a buffer, not {type(out).__name__}") from exc
    if view.readonly:
        raise InvalidValueError("get_into needs a writable buffer")
    if not view.c_contiguous:
        raise InvalidValueError("get_into needs a contiguous buffer, not a strided view")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


#: Bytes copied, written or read per step where a payload is also hashed: each piece is
#: hashed right after it lands, while it is still in the core's L2 cache (xxh3 runs there
#: several times as fast as over a whole chunk that has fallen out to L3 or memory).
HASH_PIECE = 256 << 10


def owned_copy_hashed(
    data: Any, allocate: Callable[[int], np.ndarray] = aligned_buffer
) -> tuple[np.ndarray, int]:
    """:func:`owned_copy` that also returns the :func:`checksum` of the bytes, each piece
    hashed right after it is copied (one pass over the source instead of two)."""
    sources = [_flat(part) for part in _parts_of(data)]
    out = allocate(sum(source.nbytes for source in sources))
    digest = xxhash.xxh3_64()
    at = 0
    for source in sources:
        for start in range(0, source.nbytes, HASH_PIECE):
            piece = source[start : start + HASH_PIECE]
            landed = out[at : at + piece.nbytes]
            landed[:] = piece
            digest.update(landed.data)
            at += piece.nbytes
    return out, digest.intdigest()


def owned_copy(data: Any, allocate: Callable[[int], np.ndarray] = aligned_buffer) -> np.ndarray:
    """A page-aligned private copy of a byte buffer (or of a :class:`Gathered` value's parts,
    end to end), in memory from ``allocate(nbytes)``."""
    sources = [_flat(part) for part in _parts_of(data)]
    out = allocate(sum(source.nbytes for source in sources))
    at = 0
    for source in sources:
        copy_bytes(out[at : at + source.nbytes], source)
        at += source.nbytes
    return out


def _parts_of(data: Any) -> tuple[Any, ...]:
    return data.parts if isinstance(data, Gathered) else (data,)


def _flat(data: Any) -> np.ndarray:
    """A flat uint8 array over the bytes of a buffer or array (no copy)."""
    source = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    return source.reshape(-1).view(np.uint8)


def decode_value(layout: Layout, buffer: np.ndarray) -> Any:
    """Build the value of ``layout`` over ``buffer`` (a uint8 array it takes ownership of)."""
    if layout.kind == "bytes":
        return buffer.tobytes()
    if layout.kind == "numpy":
        return buffer.view(NAME_TO_NUMPY[layout.dtype]).reshape(layout.shape)
    import torch

    return torch.from_numpy(buffer).view(torch_dtype(layout.dtype)).reshape(layout.shape)


def check_layout(layout: Layout) -> None:
    """Check ``layout`` as :func:`encode_value` checks a value's -- a known dtype of its
    kind, a shape its format allows, ``nbytes`` the size of that shape and dtype -- without
    building the value: for bytes that arrived with a layout (a remote put), where a round
    trip through torch cost more than the rest of the put. InvalidValueError if not."""
    if layout.nbytes <= 0:
        raise InvalidValueError("zero-size values cannot be stored")
    if layout.kind == "bytes":
        if (
            layout.fmt not in ("binary", "BINARY")
            or layout.dtype != "uint8"
            or layout.shape != (layout.nbytes,)
        ):
            raise InvalidValueError(f"layout {layout} does not describe a bytes value")
        return
    if layout.kind == "numpy" and layout.dtype in NAME_TO_NUMPY:
        itemsize = NAME_TO_NUMPY[layout.dtype].itemsize
    elif layout.kind == "torch":
        itemsize = torch_dtype(layout.dtype).itemsize
    else:
        raise InvalidValueError(
            f"layout {layout}: no {layout.kind} dtype is called {layout.dtype!r}"
        )
    _check_format(layout.fmt, layout.shape)
    if any(d < 0 for d in layout.shape) or layout.nbytes != itemsize * math.prod(layout.shape):
        raise InvalidValueError(f"layout {layout}: {layout.nbytes} bytes is not its shape's size")


def checksum(data: memoryview | np.ndarray | bytes) -> int:
    """64-bit xxh3 of the payload bytes (verified on every read from disk)."""
    return xxhash.xxh3_64_intdigest(data.data if isinstance(data, np.ndarray) else data)


__all__ = [
    "BYTE_FORMATS",
    "MEMORY_FORMATS",
    "NAME_TO_NUMPY",
    "Gathered",
    "Layout",
    "MemoryFormat",
    "Payload",
    "check_layout",
    "checksum",
    "decode_value",
    "dtype_name",
    "encode_value",
    "is_device_tensor",
    "owned_copy",
    "owned_copy_hashed",
    "payload_parts",
    "tensor_layout",
    "token_count",
    "torch_dtype",
    "writable_bytes",
]
