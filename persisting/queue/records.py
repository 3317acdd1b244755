"""What a queue record may hold, and the column names its keys become.

Three reserved columns sit beside the user's: ``_offset`` (stable record number), ``_ts``
(put time) and ``_keys`` (the record's keys in order, so records read back with exactly the
keys they were put with). User keys are escaped into column names that can never collide with
them or with Lance's reserved names (see :func:`column_name`). :func:`normalize_record` turns
a record's values into the forms Arrow and the log take, and refuses what cannot be stored
without pickle.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from persisting.errors import InvalidValueError
from persisting.queue.tensor_columns import encode_tensor

OFFSET = "_offset"
TIMESTAMP = "_ts"
KEYS = "_keys"
RESERVED = frozenset((OFFSET, TIMESTAMP, KEYS))

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def base_schema() -> pa.Schema:
    """The reserved columns every queue dataset starts with."""
    return pa.schema(
        [
            pa.field(OFFSET, pa.int64(), nullable=False),
            pa.field(TIMESTAMP, pa.timestamp("us", tz="UTC")),
            pa.field(KEYS, pa.string()),
        ]
    )


# -- names --------------------------------------------------------------------------------


_ESCAPED = ("%", ".", "`", "\x00")  # "%" first: it is the escape character itself


@lru_cache(maxsize=4096)
def column_name(key: str) -> str:
    """The column (or struct child) name holding ``key``: injective, never reserved.

    ``%``, ``.``, a backtick and NUL are percent-escaped (Lance cannot store or address
    them in names), a leading ``_`` becomes ``%5F`` (so no key lands on ``_offset`` or on
    Lance's ``_rowid``), and the empty key becomes ``%``.
    """
    if not key:
        return "%"
    if key[0] != "_" and not any(ch in key for ch in _ESCAPED):
        return key
    escaped = key
    for ch in _ESCAPED:
        escaped = escaped.replace(ch, f"%{ord(ch):02X}")
    if escaped.startswith("_"):
        escaped = "%5F" + escaped[1:]
    return escaped


@lru_cache(maxsize=4096)
def key_name(column: str) -> str:
    """Invert :func:`column_name`."""
    if column == "%":
        return ""
    return unquote(column) if "%" in column else column


# -- normalizing values -------------------------------------------------------------------

_SUPPORTED = (
    "bool, int, float, str, bytes, None, lists/tuples, dicts with str keys, "
    "numpy arrays and scalars, torch tensors"
)


def normalize_record(record: Any) -> dict[str, Any]:
    """A record with every value in the form Arrow and the log take.

    Tensors become :class:`EncodedTensor`, tuples lists, bytearrays bytes, and nested dicts
    are keyed by their column names. Raises InvalidValueError for what cannot be stored.
    """
    if not isinstance(record, Mapping):
        raise InvalidValueError(f"a queue record must be a dict, got {type(record).__name__}")
    out: dict[str, Any] = {}
    for key, value in record.items():
        _check_key(key, "record keys")
        out[key] = _normalize(value, key)
    return out


def _check_key(key: Any, what: str) -> None:
    if not isinstance(key, str):
        raise InvalidValueError(f"{what} must be str, got {key!r}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidValueError(f"{what} must be valid Unicode, got {key!r}") from exc


def _normalize(value: Any, path: str) -> Any:
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidValueError(f"field {path!r}: text is not valid Unicode") from exc
        return value
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise InvalidValueError(f"field {path!r}: {value} does not fit in int64")
        return int(value)
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, list | tuple):
        return [_normalize(item, f"{path}[]") for item in value]
    if isinstance(value, Mapping):
        nested: dict[str, Any] = {}
        for key, item in value.items():
            _check_key(key, f"field {path!r}: nested dict keys")
            nested[column_name(key)] = _normalize(item, f"{path}.{key}")
        return nested
    tensor = encode_tensor(value, path)
    if tensor is not None:
        return tensor
    raise InvalidValueError(
        f"field {path!r}: values of type {type(value).__name__} cannot be stored "
        f"(supported: {_SUPPORTED})"
    )


__all__ = [
    "KEYS",
    "OFFSET",
    "RESERVED",
    "TIMESTAMP",
    "base_schema",
    "column_name",
    "key_name",
    "normalize_record",
]
