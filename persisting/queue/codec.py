"""Normalized records as bytes for the write-ahead log: msgpack, arrays as an extension type.

The log must hold exactly what Lance will: bools, int64s, floats, str, bytes, None, lists,
dicts and tensors (:class:`~persisting.queue.tensor_columns.EncodedTensor`). Pickle would run
code from a file on replay; msgpack holds plain values only. A tensor is extension type
:data:`TENSOR_EXT`, whose body is the msgpack array ``[kind, dtype, shape, data]``.

"""

from __future__ import annotations

from typing import Any

import msgpack

from persisting.errors import CorruptValueError
from persisting.queue.tensor_columns import EncodedTensor

#: msgpack extension type code of an :class:`EncodedTensor`.
TENSOR_EXT = 1


def _default(value: Any) -> Any:
    """What msgpack's strict packer cannot take as is: tensors, and subclasses of plain types
    (a numpy float64 is a ``float``, a numpy ``str_`` a ``str``)."""
    if isinstance(value, EncodedTensor):
        body = [value["kind"], value["dtype"], list(value["shape"]), value["data"]]
        return msgpack.ExtType(TENSOR_EXT, msgpack.packb(body, use_bin_type=True))
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    raise TypeError(f"cannot encode {type(value).__name__} in the log")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != TENSOR_EXT:
        raise ValueError(f"unknown extension type {code}")
    kind, dtype, shape, raw = msgpack.unpackb(data, raw=False)
    if not (isinstance(kind, str) and isinstance(dtype, str) and isinstance(raw, bytes)):
        raise ValueError("malformed tensor")
    if not isinstance(shape, list) or not all(type(n) is int for n in shape):
        raise ValueError("malformed tensor shape")
    return EncodedTensor(kind=kind, dtype=dtype, shape=shape, data=raw)


# strict_types: an EncodedTensor is a dict subclass and must reach _default, not be packed
# as a plain map.
_PACKER = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)


def encode_record(record: dict[str, Any]) -> bytes:
    """Bytes for a normalized record (see :func:`persisting.queue.records.normalize_record`)."""
    return _PACKER.pack(record)


def decode_record(data: bytes | memoryview) -> dict[str, Any]:
    """Invert :func:`encode_record`; raises CorruptValueError on malformed bytes."""
    try:
        value = msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise CorruptValueError(f"malformed log record: {exc}") from exc
    except msgpack.StackError as exc:
        raise CorruptValueError("malformed log record: nested too deeply") from exc
    if not isinstance(value, dict):
        raise CorruptValueError("malformed log record: not a record")
    return value


__all__ = ["TENSOR_EXT", "decode_record", "encode_record"]
