"""The queue's established columns, and admitting records into them as rows.

Each top-level key of a record is a column a user can query (``bool``, ``int64``, ``float64``,
``large_string``, ``large_binary``, lists, structs for nested dicts). numpy arrays, numpy
scalars and torch tensors become a struct ``{kind, dtype, shape, data}`` marked by field
metadata, so they round-trip with their exact dtype and shape and without pickle
(:mod:`persisting.queue.tensor_columns`).

:class:`RecordSchema` admits normalized records (:mod:`persisting.queue.records`) as rows,
widening its columns (:mod:`persisting.queue.widening`); a value that does not fit is rejected
when it is put, before it touches the buffer or the log, so it can never block later records.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from persisting.errors import PersistingError
from persisting.queue.records import KEYS, RESERVED, column_name, key_name
from persisting.queue.tensor_columns import EncodedTensor, is_tensor_field
from persisting.queue.widening import field_delta, fit, is_nested, widen


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
            row[column] = fit(new, value) if is_nested(new) and not is_tensor_field(new) else value
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


__all__ = ["RecordSchema"]
