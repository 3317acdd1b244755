"""The tagged binary format of log records written before msgpack (segment magic PQWAL001).

Kept to read logs left by earlier versions: an upgraded bucket replays them before it writes
anything in the current format (:mod:`persisting.queue.codec`). Nothing writes it any more.
One tag byte per value, little-endian fixed-width numbers, length-prefixed strings and bytes.
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


def decode_record(data: bytes | memoryview) -> dict[str, Any]:
    """A record in the tagged format; raises CorruptValueError on malformed bytes."""
    view = memoryview(data)
    try:
        value, end = _decode(view, 0)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptValueError(f"malformed log record: {exc}") from exc
    if end != len(view) or not isinstance(value, dict):
        raise CorruptValueError("malformed log record: trailing bytes or not a record")
    return value


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


__all__ = ["decode_record"]
