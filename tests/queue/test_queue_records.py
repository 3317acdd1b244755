"""Records are typed Lance columns and come back exactly: scalars, nesting, arrays, tensors."""

from __future__ import annotations

import asyncio
import math
import tempfile
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persisting.errors import InvalidValueError, SchemaMismatchError
from persisting.queue import LanceBackend
from persisting.queue.records import column_name, key_name


def same(a: Any, b: Any) -> bool:
    """Exact equality that also compares dtype, shape and container types."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, np.generic) or isinstance(b, np.generic):
        return type(a) is type(b) and a.dtype == b.dtype and (a == b or (a != a and b != b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


def put_and_read(backend: LanceBackend, records: list[dict[str, Any]]) -> list[list[dict]]:
    """The records as read back: from the buffer, after a flush, and after reopening."""

    async def go() -> list[list[dict]]:
        first = backend.total_count()
        await backend.put_batch(records)
        buffered = await backend.get(len(records), first)
        await backend.flush()
        flushed = await backend.get(len(records), first)
        return [buffered, flushed, first]

    buffered, flushed, first = asyncio.run(go())
    path = backend.bucket_dir
    backend.close()
    reopened = LanceBackend(bucket_id=0, storage_path=path, read_only=True)
    try:
        again = asyncio.run(reopened.get(len(records), first))
    finally:
        reopened.close()
    return [buffered, flushed, again]


ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array([[1, -2], [3, 4]], dtype=">i8"),  # big-endian stays big-endian
    np.arange(24, dtype=np.int16).reshape(2, 3, 4)[:, ::2, 1:],  # not contiguous
    np.array(3.5, dtype=np.float64),  # 0-d
    np.zeros((0, 3), dtype=np.uint8),  # empty
    np.array([True, False]),
    np.array([1 + 2j], dtype=np.complex64),
    np.array(["ab", "c"]),
    np.array(["2024-01-01"], dtype="datetime64[ns]"),
    np.array([np.nan, np.inf], dtype=np.float16),
]
TENSORS = [
    torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    torch.ones(2, 2, dtype=torch.float16).t(),  # not contiguous
    torch.tensor(7, dtype=torch.int64),  # 0-d
    torch.empty(0, 4),
    torch.tensor([True, False]),
    torch.arange(4, dtype=torch.uint8),
    torch.randn(3, requires_grad=True),
]


def test_scalars_lists_nested_dicts_and_none_round_trip(open_backend) -> None:
    records = [
        {
            "id": "a",
            "flag": True,
            "n": -(2**63),
            "x": 1.5,
            "text": "héllo",
            "raw": b"\x00\xff",
            "nothing": None,
            "ints": [1, 2, 3],
            "nested": {"a": 1, "b": {"c": ["x", "y"]}, "flag": False},
            "rows": [{"k": 1}, {"k": 2}],
            "empty": [],
            "empty_dict": {},
            "matrix": [[1.0, 2.0], [3.0]],
        },
        {"id": "b", "flag": False, "n": 2**63 - 1, "x": float("nan"), "ints": [], "nothing": None},
        {"id": "c"},
        {},
    ]
    for got in put_and_read(open_backend(), records):
        assert len(got) == len(records)
        for want, have in zip(records, got, strict=True):
            assert same(want, have), (want, have)


def test_arrays_and_tensors_keep_dtype_and_shape_exactly(open_backend) -> None:
    scalars = [np.float32(1.25), np.int8(-3), np.bool_(True), np.uint64(2**64 - 1)]
    records = [{"id": i, "value": v} for i, v in enumerate(ARRAYS + scalars + TENSORS)]
    records.append({"id": 99, "many": [np.ones(2, np.float32), None], "inner": {"t": TENSORS[0]}})
    for got in put_and_read(open_backend(), records):
        for want, have in zip(records, got, strict=True):
            want = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in want.items()}
            assert same(want, have), (want, have)
            if isinstance(have.get("value"), np.ndarray):
                have["value"].flat[:1] = have["value"].flat[:1]  # writable, owned arrays


def test_records_are_typed_columns_a_user_can_query(open_backend) -> None:
    backend = open_backend()
    records = [
        {"id": f"k{i}", "seq": i, "score": i / 2, "ok": i % 2 == 0, "meta": {"src": "a"}}
        for i in range(10)
    ]
    records[3]["embedding"] = np.ones(4, dtype=np.float32)
    asyncio.run(backend.put_batch(records))
    asyncio.run(backend.flush())
    dataset = lance.dataset(str(backend.path))
    types = {f.name: f.type for f in dataset.schema}
    assert types["seq"] == pa.int64()
    assert types["score"] == pa.float64()
    assert types["ok"] == pa.bool_()
    assert types["id"] == pa.large_string()
    assert pa.types.is_struct(types["meta"])
    assert pa.types.is_struct(types["embedding"])  # {kind, dtype, shape, data}, no pickle
    picked = dataset.to_table(filter="ok AND seq > 4 AND meta.src = 'a'", columns=["_offset", "id"])
    assert picked.to_pylist() == [{"_offset": 6, "id": "k6"}, {"_offset": 8, "id": "k8"}]
    shape = dataset.to_table(filter="embedding IS NOT NULL", columns=["embedding"])
    assert shape.column("embedding")[0].as_py()["shape"] == [4]
    assert shape.column("embedding")[0].as_py()["dtype"] == "<f4"


def test_a_changed_field_type_is_rejected_at_put_and_blocks_nothing(open_backend) -> None:
    backend = open_backend()

    async def go() -> list[dict]:
        await backend.put({"id": "a", "v": 1})
        with pytest.raises(SchemaMismatchError, match="'v' is int64"):
            await backend.put({"id": "b", "v": "one"})
        with pytest.raises(SchemaMismatchError, match="record 1 of 2"):
            await backend.put_batch([{"id": "c", "v": 3}, {"id": "d", "v": [1]}])
        await backend.put({"id": "e", "v": 5})  # later records are fine ...
        await backend.flush()  # ... and so is the flush
        await backend.put({"id": "f", "v": 2.5, "w": 1})  # float where int: rejected
        return await backend.get(10, 0)

    with pytest.raises(SchemaMismatchError):
        asyncio.run(go())
    asyncio.run(backend.put({"id": "g", "v": 7}))
    asyncio.run(backend.flush())
    got = asyncio.run(backend.get(10, 0))
    assert [r["id"] for r in got] == ["a", "e", "g"]
    assert [r["v"] for r in got] == [1, 5, 7]
    assert backend.total_count() == 3  # rejected records took no offsets


def test_new_keys_and_nested_fields_widen_the_schema_additively(open_backend) -> None:
    backend = open_backend()

    async def go() -> list[dict]:
        await backend.put({"id": "a", "nested": {"x": 1}, "rows": [{"k": 1}]})
        await backend.flush()
        await backend.put({"id": "b", "nested": {"x": 2, "y": "new"}, "rows": [{"j": True}]})
        await backend.put({"id": "c", "extra": 0.5, "score": 1.5})
        await backend.put({"id": "d", "score": 2})  # an int fits a float64 column exactly
        await backend.flush()
        return await backend.get(10, 0)

    got = asyncio.run(go())
    assert got[0] == {"id": "a", "nested": {"x": 1, "y": None}, "rows": [{"k": 1, "j": None}]}
    assert got[1] == {"id": "b", "nested": {"x": 2, "y": "new"}, "rows": [{"k": None, "j": True}]}
    assert got[2] == {"id": "c", "extra": 0.5, "score": 1.5}
    assert got[3] == {"id": "d", "score": 2.0} and isinstance(got[3]["score"], float)
    names = lance.dataset(str(backend.path)).schema.names
    assert names[:3] == ["_offset", "_ts", "_keys"]
    assert {"id", "nested", "rows", "extra", "score"} <= set(names)


def test_unstorable_values_are_rejected_with_a_clear_error(open_backend) -> None:
    backend = open_backend()
    bad = [
        ({"s": {1, 2}}, "set"),
        ({"o": np.array([object()])}, "object"),
        ({"big": 2**64}, "int64"),
        ({1: "non-str key"}, "keys must be str"),
        ({"d": {2: "x"}}, "keys must be str"),
        ({"f": open}, "builtin_function_or_method"),
        ({"\ud800": 1}, "Unicode"),
        ({"t": "bad \udcff text"}, "Unicode"),
    ]
    for record, message in bad:
        with pytest.raises(InvalidValueError, match=message):
            asyncio.run(backend.put(record))
    with pytest.raises(InvalidValueError):
        asyncio.run(backend.put("not a record"))  # type: ignore[arg-type]
    assert backend.total_count() == 0


def test_awkward_keys_round_trip_and_never_hit_reserved_columns(open_backend) -> None:
    records = [
        {"_offset": "mine", "_ts": 1, "_keys": [1], "_rowid": 2, "a.b": 3, "%2E": 4, "": 5},
        {"nested": {"a.b": {"_x": 1}, "%": 2, "": 3, "`q`": 4, "nul\x00": 5}, "%": 6},
        {"a b/c:d[0]": 1, "é💥": 2, "`": 3, "*": 4, "SELECT": 5, "a,b": 6},
    ]
    for got in put_and_read(open_backend(), records):
        assert got == records
    for key in ["_rowid", "a.b", "%41", "_", ".", "plain", "", "%", "`", "\x00", "%00"]:
        column = column_name(key)
        assert key_name(column) == key
        assert column and not column.startswith("_")
        assert not any(ch in column for ch in ".`\x00")
    assert len({column_name(k) for k in ["", "%", "%25", "%2525"]}) == 4


def untyped(value: Any) -> bool:
    """None and containers holding only such values (nothing to infer a type from)."""
    if isinstance(value, list):
        return all(map(untyped, value))
    if isinstance(value, dict):
        return all(map(untyped, value.values()))
    return value is None


def stored_alike(want: Any, have: Any) -> bool:
    """Equal up to the documented normalizations of nested values: an int in a float column
    reads as a float, a nested dict reads with every field of its struct (None for missing
    ones), and an empty container at a nested place no record has typed yet reads as None."""
    if untyped(want) and have is None:
        return True
    if isinstance(want, dict):
        return (
            isinstance(have, dict)
            and all(
                stored_alike(want.get(k), v) if k in want else v is None for k, v in have.items()
            )
            and all(untyped(v) for k, v in want.items() if k not in have)
        )
    if isinstance(want, list):
        return (
            isinstance(have, list) and len(want) == len(have) and all(map(stored_alike, want, have))
        )
    if isinstance(want, int) and not isinstance(want, bool) and isinstance(have, float):
        return float(want) == have
    return type(want) is type(have) and want == have


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
record_lists = st.lists(st.dictionaries(st.text(max_size=4), json_values, max_size=4), max_size=5)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@pytest.mark.slow
@given(batches=st.lists(record_lists, min_size=1, max_size=3), flush_between=st.booleans())
def test_any_records_are_stored_or_rejected_whole_and_never_block_a_flush(
    tmp_path: Path, batches: list[list[dict]], flush_between: bool
) -> None:
    path = Path(tempfile.mkdtemp(dir=tmp_path))  # hypothesis reuses tmp_path
    backend = LanceBackend(bucket_id=0, storage_path=path, batch_size=10**6, flush_interval_s=0)
    try:

        async def go() -> tuple[list[dict], list[dict], list[dict]]:
            accepted: list[dict] = []
            for batch in batches:
                before = backend.total_count()
                try:
                    await backend.put_batch(batch)
                    accepted.extend(batch)
                except SchemaMismatchError:
                    assert backend.total_count() == before  # a misfit leaves no trace
                if flush_between:
                    await backend.flush()
            buffered = await backend.get(100, 0)
            await backend.flush()
            await backend.put({"after": True})  # nothing is ever blocked
            await backend.flush()
            return accepted, buffered, await backend.get(100, 0)

        accepted, buffered, flushed = asyncio.run(go())
        assert flushed[-1] == {"after": True}
        for got in (buffered, flushed[:-1]):
            assert len(got) == len(accepted)
            for want, have in zip(accepted, got, strict=True):
                assert list(want) == list(have)  # top-level keys exactly, in order
                for key, value in want.items():
                    assert stored_alike(value, have[key]), (key, value, have[key])
    finally:
        backend.close()


def test_an_empty_nested_list_does_not_poison_a_later_type(open_backend) -> None:
    backend = open_backend()

    async def go() -> list[dict]:
        await backend.put({"s": {"a": [], "b": 1}, "l": [{"x": []}, {"y": 1}]})
        await backend.put({"s": {"a": 5}, "l": [{"x": "now typed"}]})
        await backend.flush()
        return await backend.get(10, 0)

    got = asyncio.run(go())
    assert got[0] == {"s": {"b": 1, "a": None}, "l": [{"y": None, "x": None}, {"y": 1, "x": None}]}
    assert got[1] == {"s": {"b": None, "a": 5}, "l": [{"y": None, "x": "now typed"}]}
