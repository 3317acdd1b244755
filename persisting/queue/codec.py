"""A compact, self-describing binary encoding of normalized records for the write-ahead log.

The log must hold exactly what Lance will: bools, int64s, floats, str, bytes, None, lists,
nested dicts and tensors (as :class:`~persisting.queue.tensor_columns.EncodedTensor`). Pickle would
do it but would execute code from a file on replay, so this is a small tagged format instead:
one tag byte per value, little-endian fixed-width numbers, length-prefixed strings and bytes.
"""

from __future__ import annotations

import struct
from typing import Any

from persisting.errors import CorruptValueError
from persisting.queue.tensor_columns import EncodedTensor

_NONE, _TRUE, _FALSE = b"N", b"T", b"F"
_INT, _FLOAT, _STR, _BYTES = b"i", b"d", b"s", b"b"
_LIST, _DICT, _TENSOR = b"l", b"m", b"t"

_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def encode_record(record: dict[str, Any]) -> bytes:
    """Bytes for a normalized record (see :func:`persisting.queue.records.normalize_record`)."""
    out: list[bytes] = []
    _encode(record, out)
    return b"".join(out)


def decode_record(data: bytes | memoryview) -> dict[str, Any]:
    """Invert :func:`encode_record`; raises CorruptValueError on malformed bytes."""
    view = memoryview(data)
    try:
        value, end = _decode(view, 0)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptValueError(f"malformed log record: {exc}") from exc
    if end != len(view) or not isinstance(value, dict):
        raise CorruptValueError("malformed log record: trailing bytes or not a record")
    return value


def _encode_str(text: str, out: list[bytes]) -> None:
    raw = text.encode("utf-8")
    out.append(_U64.pack(len(raw)))
    out.append(raw)


def _encode(value: Any, out: list[bytes]) -> None:
    if value is None:
        out.append(_NONE)
    elif value is True:
        out.append(_TRUE)
    elif value is False:
        out.append(_FALSE)
    elif isinstance(value, int):
        out.append(_INT)
        out.append(_Q.pack(value))
    elif isinstance(value, float):
        out.append(_FLOAT)
        out.append(_D.pack(value))
    elif isinstance(value, str):
        out.append(_STR)
        _encode_str(value, out)
    elif isinstance(value, bytes):
        out.append(_BYTES)
        out.append(_U64.pack(len(value)))
        out.append(value)
    elif isinstance(value, EncodedTensor):
        out.append(_TENSOR)
        _encode_str(value["kind"], out)
        _encode_str(value["dtype"], out)
        shape = value["shape"]
        out.append(_U32.pack(len(shape)))
        out.extend(_Q.pack(n) for n in shape)
        out.append(_U64.pack(len(value["data"])))
        out.append(value["data"])
    elif isinstance(value, list):
        out.append(_LIST)
        out.append(_U32.pack(len(value)))
        for item in value:
            _encode(item, out)
    elif isinstance(value, dict):
        out.append(_DICT)
        out.append(_U32.pack(len(value)))
        for key, item in value.items():
            _encode_str(key, out)
            _encode(item, out)
    else:  # normalize_record never produces anything else
        raise TypeError(f"cannot encode {type(value).__name__} in the log")


def _decode_str(view: memoryview, pos: int) -> tuple[str, int]:
    (size,) = _U64.unpack_from(view, pos)
    pos += 8
    end = pos + size
    if end > len(view):
        raise ValueError("string runs past the end")
    return str(view[pos:end], "utf-8"), end


def _decode(view: memoryview, pos: int) -> tuple[Any, int]:
    tag = view[pos : pos + 1].tobytes()
    pos += 1
    if tag == _NONE:
        return None, pos
    if tag == _TRUE:
        return True, pos
    if tag == _FALSE:
        return False, pos
    if tag == _INT:
        return _Q.unpack_from(view, pos)[0], pos + 8
    if tag == _FLOAT:
        return _D.unpack_from(view, pos)[0], pos + 8
    if tag == _STR:
        return _decode_str(view, pos)
    if tag == _BYTES:
        (size,) = _U64.unpack_from(view, pos)
        pos += 8
        if pos + size > len(view):
            raise ValueError("bytes run past the end")
        return view[pos : pos + size].tobytes(), pos + size
    if tag == _LIST:
        (count,) = _U32.unpack_from(view, pos)
        pos += 4
        items = []
        for _ in range(count):
            item, pos = _decode(view, pos)
            items.append(item)
        return items, pos
    if tag == _DICT:
        (count,) = _U32.unpack_from(view, pos)
        pos += 4
        mapping: dict[str, Any] = {}
        for _ in range(count):
            key, pos = _decode_str(view, pos)
            mapping[key], pos = _decode(view, pos)
        return mapping, pos
    if tag == _TENSOR:
        kind, pos = _decode_str(view, pos)
        dtype, pos = _decode_str(view, pos)
        (ndim,) = _U32.unpack_from(view, pos)
        pos += 4
        shape = [_Q.unpack_from(view, pos + 8 * i)[0] for i in range(ndim)]
        pos += 8 * ndim
        (size,) = _U64.unpack_from(view, pos)
        pos += 8
        if pos + size > len(view):
            raise ValueError("tensor data runs past the end")
        data = view[pos : pos + size].tobytes()
        return EncodedTensor(kind=kind, dtype=dtype, shape=shape, data=data), pos + size
    raise ValueError(f"unknown tag {tag!r} at {pos - 1}")


__all__ = ["decode_record", "encode_record"]
