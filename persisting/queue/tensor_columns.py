"""numpy arrays, numpy scalars and torch tensors as typed Lance values, without pickle.

A tensor is stored as the struct ``{kind, dtype, shape, data}``: ``kind`` says what to give
back (``numpy``, ``numpy_scalar`` or ``torch``), ``dtype`` is numpy's dtype string (byte order
included) or torch's dtype name (``bfloat16`` has no numpy twin), ``shape`` the dimensions and
``data`` the C-order bytes. The field carries ``persisting.type = tensor`` metadata, so a
user's own dict with those four keys is never mistaken for a tensor. Object and structured
numpy dtypes are refused: they cannot be stored without pickle.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from persisting.errors import CorruptValueError, InvalidValueError

TENSOR_MARK = {b"persisting.type": b"tensor"}
TENSOR_TYPE = pa.struct(
    [
        pa.field("kind", pa.string()),
        pa.field("dtype", pa.string()),
        pa.field("shape", pa.list_(pa.int64())),
        pa.field("data", pa.large_binary()),
    ]
)


class EncodedTensor(dict):
    """A numpy array, numpy scalar or torch tensor as ``{kind, dtype, shape, data}``.

    A ``dict`` so Arrow converts it straight into the tensor struct; its own type so the
    schema and the log can tell it from a user's nested dict.
    """


def _torch_module() -> Any:
    return sys.modules.get("torch")


def encode_tensor(value: Any, path: str) -> EncodedTensor | None:
    """``value`` as an :class:`EncodedTensor`, or None if it is not an array or tensor."""
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.hasobject or array.dtype.fields is not None:
            raise InvalidValueError(
                f"field {path!r}: numpy dtype {array.dtype} cannot be stored without pickle "
                "(object and structured dtypes are not supported)"
            )
        return EncodedTensor(
            kind="numpy" if isinstance(value, np.ndarray) else "numpy_scalar",
            dtype=array.dtype.str,
            shape=list(array.shape),
            data=array.tobytes(order="C"),
        )
    torch = _torch_module()
    if torch is not None and isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise InvalidValueError(
                f"field {path!r}: only dense (strided, unquantized) torch tensors can be stored"
            )
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        flat = tensor.contiguous().reshape(-1)
        return EncodedTensor(
            kind="torch",
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=list(tensor.shape),
            data=flat.view(torch.uint8).numpy().tobytes(),
        )
    return None


def decode_tensor(value: Mapping[str, Any]) -> Any:
    """The numpy array, numpy scalar or torch tensor an :class:`EncodedTensor` describes."""
    kind, dtype_name, shape, data = value["kind"], value["dtype"], value["shape"], value["data"]
    shape = tuple(int(n) for n in shape)
    count = math.prod(shape)
    if kind in ("numpy", "numpy_scalar"):
        dtype = np.dtype(dtype_name)
        if len(data) != count * dtype.itemsize:
            raise CorruptValueError(
                f"tensor data is {len(data)} bytes, expected {count * dtype.itemsize} "
                f"for {dtype} {list(shape)}"
            )
        array = np.frombuffer(data, dtype=dtype, count=count).reshape(shape).copy()
        return array[()] if kind == "numpy_scalar" else array
    if kind == "torch":
        import torch

        torch_dtype = getattr(torch, dtype_name, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise CorruptValueError(f"unknown torch dtype {dtype_name!r}")
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        if len(data) != count * itemsize:
            raise CorruptValueError(
                f"tensor data is {len(data)} bytes, expected {count * itemsize} "
                f"for {dtype_name} {list(shape)}"
            )
        if count == 0:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)
    raise CorruptValueError(f"unknown tensor kind {kind!r}")


def is_tensor_field(field: pa.Field) -> bool:
    return field.metadata is not None and field.metadata.get(b"persisting.type") == b"tensor"


def tensor_field(name: str) -> pa.Field:
    return pa.field(name, TENSOR_TYPE, metadata=TENSOR_MARK)


__all__ = [
    "TENSOR_MARK",
    "TENSOR_TYPE",
    "EncodedTensor",
    "decode_tensor",
    "encode_tensor",
    "is_tensor_field",
    "tensor_field",
]
