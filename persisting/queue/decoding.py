"""Stored rows back into records: Lance tables column by column, buffered rows one by one.

Each record's ``_keys`` column lists its keys in put order (and, for values no column can
hold, such as ``None`` inside an untyped place, the value itself), so a record reads back with
exactly the keys and values it was put with.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow as pa

from persisting.errors import CorruptValueError
from persisting.queue.records import KEYS, RESERVED, column_name, key_name
from persisting.queue.tensor_columns import decode_tensor, is_tensor_field

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


__all__ = ["RecordDecoder"]
