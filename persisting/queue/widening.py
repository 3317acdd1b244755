"""Widening a column's Arrow type to hold one more value, and what must be added to a dataset.

The schema only ever widens additively: a new key adds a column, a new key inside a nested
dict adds a struct child. A value that cannot be stored in its established column (a float
where the column is ``int64``) is a SchemaMismatchError, raised when the record is put.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from persisting.errors import InvalidValueError, SchemaMismatchError
from persisting.queue.records import key_name
from persisting.queue.tensor_columns import EncodedTensor, is_tensor_field, tensor_field


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
        if not is_nested(item):
            return value
        return [fit(item, element) for element in value]
    return value


def is_nested(field: pa.Field) -> bool:
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


__all__ = ["field_delta", "fit", "is_nested", "widen"]
