"""Queue records as typed Lance columns, and back.

Each top-level key of a record is a column a user can query (``bool``, ``int64``, ``float64``,
``large_string``, ``large_binary``, lists, structs for nested dicts). numpy arrays, numpy
scalars and torch tensors become a struct ``{kind, dtype, shape, data}`` marked by field
metadata, so they round-trip with their exact dtype and shape and without pickle.

The schema only ever widens additively: a new key adds a column, a new key inside a nested
dict adds a struct child. A value that cannot be stored in its established column (a float
where the column is ``int64``) is rejected when it is put, before it touches the buffer or the
log, so it can never block later records.

Three reserved columns sit beside the user's: ``_offset`` (stable record number), ``_ts``
(put time) and ``_keys`` (the record's keys in order, so records read back with exactly the
keys they were put with). User keys are escaped into column names that can never collide with
them or with Lance's reserved names (see :func:`column_name`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from persisting.errors import (
    CorruptValueError,
    InvalidValueError,
    PersistingError,
    SchemaMismatchError,
)
from persisting.queue.tensors import (
    EncodedTensor,
    decode_tensor,
    encode_tensor,
    is_tensor_field,
    tensor_field,
)

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


# -- widening -----------------------------------------------------------------------------


def _describe(field: pa.Field) -> str:
    return "tensor" if is_tensor_field(field) else str(field.type)


def _conflict(field: pa.Field, value: Any, path: str) -> SchemaMismatchError:
    got = "tensor" if isinstance(value, EncodedTensor) else type(value).__name__
    return SchemaMismatchError(
        f"field {path!r} is {_describe(field)} in this queue; a {got} cannot be stored there. "
        "The record was rejected; other records are not affected (use a new key for the new type)"
    )


def widen(
    field: pa.Field | None, value: Any, name: str, path: str, fresh: bool = False
) -> pa.Field | None:
    """The narrowest field that holds what ``field`` holds and ``value`` (normalized).

    Returns ``field`` itself when nothing changes and None while the value carries no type
    (None, empty lists, lists of None, empty dicts). Raises SchemaMismatchError when the
    value's type differs from the established one. ``fresh`` says ``field`` was inferred
    from this same value (the items of one list), so an int64 may still become float64.
    """
    if value is None:
        return field
    if isinstance(value, EncodedTensor):
        if field is None:
            return tensor_field(name)
        if is_tensor_field(field):
            return field
        raise _conflict(field, value, path)
    if isinstance(value, bool):
        return _scalar(field, value, name, path, pa.bool_())
    if isinstance(value, int):
        if field is not None and pa.types.is_float64(field.type):
            return field  # an int is stored exactly in a float64 column (|n| < 2**53)
        return _scalar(field, value, name, path, pa.int64())
    if isinstance(value, float):
        if fresh and field is not None and pa.types.is_int64(field.type):
            return pa.field(name, pa.float64())  # [1, 2.5]: the list is of floats
        return _scalar(field, value, name, path, pa.float64())
    if isinstance(value, str):
        return _scalar(field, value, name, path, pa.large_string())
    if isinstance(value, bytes):
        return _scalar(field, value, name, path, pa.large_binary())
    if isinstance(value, list):
        return _widen_list(field, value, name, path, fresh)
    if isinstance(value, dict):
        if field is not None and (not pa.types.is_struct(field.type) or is_tensor_field(field)):
            raise _conflict(field, value, path)
        children: dict[str, pa.Field | None] = (
            {child.name: child for child in field.type} if field is not None else {}
        )
        changed = False
        for child_name, child_value in value.items():
            old = children.get(child_name)
            child_path = f"{path}.{key_name(child_name)}"
            new = widen(old, child_value, child_name, child_path, fresh or old is None)
            if new is not old:
                children[child_name] = new
                changed = True
        if not changed:
            return field
        typed = [child for child in children.values() if child is not None]
        return pa.field(name, pa.struct(typed)) if typed else field
    raise InvalidValueError(f"field {path!r}: unsupported value {type(value).__name__}")


def _widen_list(
    field: pa.Field | None, value: list, name: str, path: str, fresh: bool
) -> pa.Field | None:
    if field is not None and (not pa.types.is_list(field.type) or is_tensor_field(field)):
        raise _conflict(field, value, path)
    old_item = field.type.value_field if field is not None else None
    item = old_item
    item_path = f"{path}[]"
    for element in value:
        item = widen(item, element, "item", item_path, fresh or old_item is None)
    if item is None:
        return field
    # Every element must fit the final item type: [[], 1] or [{}, "x"] mix kinds.
    for element in value:
        widen(item, element, "item", item_path)
    if item is old_item:
        return field
    return pa.field(name, pa.list_(item))


def _scalar(
    field: pa.Field | None, value: Any, name: str, path: str, wanted: pa.DataType
) -> pa.Field:
    if field is None:
        return pa.field(name, wanted)
    if field.type.equals(wanted) and not is_tensor_field(field):
        return field
    raise _conflict(field, value, path)


def fit(field: pa.Field | None, value: Any) -> Any:
    """``value`` shaped for ``field``: struct children as the struct has them, and None
    wherever the field has no type yet (an empty list under a struct child no record has
    typed), so the row still converts whatever types later records give those places."""
    if value is None or field is None:
        return None
    if is_tensor_field(field):
        return value
    kind = field.type
    if pa.types.is_struct(kind):
        return {child.name: fit(child, value.get(child.name)) for child in kind}
    if pa.types.is_list(kind):
        item = kind.value_field
        if not _is_nested(item):
            return value
        return [fit(item, element) for element in value]
    return value


def _is_nested(field: pa.Field) -> bool:
    return pa.types.is_struct(field.type) or pa.types.is_list(field.type)


def field_delta(old: pa.Field | None, new: pa.Field) -> pa.Field | None:
    """What must be added to a dataset holding ``old`` so it holds ``new`` (None: nothing).

    New columns come whole; new struct children come as a struct of just the new children
    (Lance merges them into the existing struct), also inside lists.
    """
    if old is None:
        return new
    if pa.types.is_struct(new.type) and not is_tensor_field(new):
        old_children = {child.name: child for child in old.type}
        added = []
        for child in new.type:
            delta = field_delta(old_children.get(child.name), child)
            if delta is not None:
                added.append(delta)
        return pa.field(new.name, pa.struct(added)) if added else None
    if pa.types.is_list(new.type):
        delta = field_delta(old.type.value_field, new.type.value_field)
        return pa.field(new.name, pa.list_(delta)) if delta is not None else None
    return None


# -- the established schema ---------------------------------------------------------------


class RecordSchema:
    """The queue's established user columns, widened as records are admitted."""

    def __init__(self, schema: pa.Schema):
        self._fields: dict[str, pa.Field] = {f.name: f for f in schema if f.name not in RESERVED}
        self.generation = 0
        self._keys_cache: dict[tuple[str, ...], str] = {}
        self._scalar_fits: dict[tuple[str, type], pa.Field] = {}

    def fields(self) -> list[pa.Field]:
        return list(self._fields.values())

    def admit(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rows (column name -> value, plus ``_keys``) for normalized ``records``.

        All records are checked first: if one does not fit, SchemaMismatchError is raised
        and the schema is unchanged, so a rejected batch leaves no trace.
        """
        staged = dict(self._fields)
        rows = []
        for index, record in enumerate(records):
            try:
                rows.append(self._admit_one(record, staged))
            except PersistingError as exc:
                if len(records) == 1:
                    raise
                raise type(exc)(f"record {index} of {len(records)}: {exc}") from exc
        if len(staged) != len(self._fields) or any(
            staged[name] is not field for name, field in self._fields.items()
        ):
            self._fields = staged
            self.generation += 1
        return rows

    def _admit_one(self, record: Mapping[str, Any], fields: dict[str, pa.Field]) -> dict[str, Any]:
        row: dict[str, Any] = {}
        entries: list[Any] = []
        plain = True
        fast = self._scalar_fits
        for key, value in record.items():
            column = column_name(key)
            old = fields.get(column)
            kind = type(value)
            if old is not None and fast.get((column, kind)) is old:
                row[column] = value  # a scalar of a type this very column already took
                entries.append(key)
                continue
            new = widen(old, value, column, key)
            if new is not None and kind in _SCALARS:
                fast[(column, kind)] = new
            if new is None or (old is not None and new is old and _untyped(value)):
                if value is None and old is not None:
                    entries.append(key)  # the column reads null: exactly None
                    continue
                entries.append([key, _as_user_value(value)])  # no column can say it
                plain = False
                continue
            if new is not old:
                fields[column] = new
            row[column] = fit(new, value) if _is_nested(new) and not is_tensor_field(new) else value
            entries.append(key)
        row[KEYS] = self._keys_json(entries) if plain else json.dumps(entries)
        return row

    def _keys_json(self, keys: list[str]) -> str:
        cache_key = tuple(keys)
        text = self._keys_cache.get(cache_key)
        if text is None:
            text = json.dumps(keys)
            if len(self._keys_cache) < 4096:
                self._keys_cache[cache_key] = text
        return text

    def deltas(self, existing: pa.Schema) -> list[pa.Field]:
        """Fields to add to a dataset with schema ``existing`` so it holds every column."""
        out = []
        for field in self._fields.values():
            index = existing.get_field_index(field.name)
            old = existing.field(index) if index >= 0 else None
            delta = field_delta(old, field)
            if delta is not None:
                out.append(delta)
        return out


def _as_user_value(value: Any) -> Any:
    """An untyped normalized value with its nested keys as the user wrote them."""
    if isinstance(value, list):
        return [_as_user_value(v) for v in value]
    if isinstance(value, dict):
        return {key_name(k): _as_user_value(v) for k, v in value.items()}
    return value


_SCALARS = frozenset((bool, int, float, str, bytes))


def _untyped(value: Any) -> bool:
    """True for values that carry no type: None and containers holding only such values."""
    if value is None:
        return True
    if isinstance(value, list):
        return all(_untyped(v) for v in value)
    if isinstance(value, dict) and not isinstance(value, EncodedTensor):
        return all(_untyped(v) for v in value.values())
    return False


# -- decoding -----------------------------------------------------------------------------

Decoder = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _decoder_for(field: pa.Field) -> Decoder | None:
    """A function turning Arrow's Python value of ``field`` into the user's value (None: as is)."""
    if is_tensor_field(field):
        return lambda v: None if v is None else decode_tensor(v)
    if pa.types.is_list(field.type):
        item = _decoder_for(field.type.value_field)
        if item is None:
            return None
        return lambda v: None if v is None else [None if x is None else item(x) for x in v]
    if pa.types.is_struct(field.type):
        children = [
            (child.name, key_name(child.name), _decoder_for(child) or _identity)
            for child in field.type
        ]

        def struct(v: Any) -> Any:
            if v is None:
                return None
            out = {}
            for column, key, decode in children:
                item = v.get(column)
                out[key] = None if item is None else decode(item)
            return out

        return struct
    return None


class RecordDecoder:
    """Turns stored rows (a Lance table, or buffered rows) back into records."""

    def __init__(self, fields: Iterable[pa.Field]):
        self._decoders: dict[str, Decoder] = {}
        for field in fields:
            if field.name in RESERVED:
                continue
            decoder = _decoder_for(field)
            if decoder is not None:
                self._decoders[field.name] = decoder
        self._plans: dict[str, list[tuple[str, str | None, Any]]] = {}

    def _plan(self, keys_text: str) -> list[tuple[str, str | None, Any]]:
        """``(key, column, literal)`` per key of a row; ``column`` is None for literals."""
        plan = self._plans.get(keys_text)
        if plan is not None:
            return plan
        try:
            entries = json.loads(keys_text)
        except (TypeError, ValueError) as exc:
            raise CorruptValueError(f"unreadable record keys {keys_text!r}") from exc
        plan = [
            (entry, column_name(entry), None)
            if isinstance(entry, str)
            else (entry[0], None, entry[1])
            for entry in entries
        ]
        if all(column is not None for _, column, _ in plan) and len(self._plans) < 4096:
            self._plans[keys_text] = plan  # literals must not be shared between records
        return plan

    def decode(self, row: Mapping[str, Any]) -> dict[str, Any]:
        record: dict[str, Any] = {}
        for key, column, literal in self._plan(row[KEYS]):
            if column is None:
                record[key] = literal
                continue
            value = row.get(column)
            decoder = self._decoders.get(column)
            record[key] = value if value is None or decoder is None else decoder(value)
        return record

    def decode_table(self, table: pa.Table) -> list[dict[str, Any]]:
        """Records of a table read from Lance, converted column by column (much faster)."""
        columns: dict[str, list[Any]] = {}
        for name in table.column_names:
            if name in RESERVED:
                continue
            values = table.column(name).to_pylist()
            decoder = self._decoders.get(name)
            if decoder is not None:
                values = [None if v is None else decoder(v) for v in values]
            columns[name] = values
        records = []
        for index, keys_text in enumerate(table.column(KEYS).to_pylist()):
            record: dict[str, Any] = {}
            for key, column, literal in self._plan(keys_text):
                if column is None:
                    record[key] = literal
                else:
                    values = columns.get(column)
                    record[key] = None if values is None else values[index]
            records.append(record)
        return records


__all__ = [
    "KEYS",
    "OFFSET",
    "RESERVED",
    "TIMESTAMP",
    "RecordDecoder",
    "RecordSchema",
    "base_schema",
    "column_name",
    "field_delta",
    "fit",
    "key_name",
    "normalize_record",
    "widen",
]
