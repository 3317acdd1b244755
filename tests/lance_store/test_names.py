"""Names become exactly one path component: reversible, distinct, never escaping."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persisting.errors import InvalidNameError, PersistingError
from persisting.lance_store import StorageRoot, decode_name, encode_name

HOSTILE = [
    "..",
    ".",
    "../x",
    "../../etc/passwd",
    "/abs/path",
    "a/b",
    "a_b",
    "a%2Fb",
    "a\\b",
    "~",
    ".hidden",
    "meta-llama/Llama-3-8B",
    "Qwen/Qwen2.5-7B-Instruct@lora:v2",
    "模型/名字",
    " leading space",
    "COM1",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_stay_inside_their_directory(tmp_path: Path, name: str) -> None:
    store = StorageRoot(tmp_path)
    for path, parent in (
        (store.kv_path(name), tmp_path / "kv"),
        (store.topic_dir(name), tmp_path / "queue"),
    ):
        assert path.parent == parent
        assert path.resolve().parent == parent.resolve()
        assert path.name not in (".", "..", "")
        assert "/" not in path.name
    qp = store.queue_path(name, 3)
    assert qp.parts[-2:] == ("bucket_3", "data.lance")
    assert qp.parents[2] == tmp_path / "queue"


def test_distinct_names_stay_distinct(tmp_path: Path) -> None:
    store = StorageRoot(tmp_path)
    paths = {store.kv_path(n) for n in HOSTILE}
    assert len(paths) == len(HOSTILE)
    assert store.kv_path("a/b") != store.kv_path("a_b")


@pytest.mark.parametrize("bad", ["", "a\x00b", "line\nbreak", "tab\t", "x" * 201, "\x7f"])
def test_bad_names_are_refused_before_touching_disk(tmp_path: Path, bad: str) -> None:
    store = StorageRoot(tmp_path / "root")
    with pytest.raises(InvalidNameError):
        store.kv_path(bad)
    with pytest.raises(PersistingError):
        store.queue_path(bad, 0)
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("bad_id", [-1, "0", 1.5, True, None])
def test_bucket_ids_must_be_non_negative_ints(tmp_path: Path, bad_id: object) -> None:
    with pytest.raises(InvalidNameError):
        StorageRoot(tmp_path).queue_path("t", bad_id)  # type: ignore[arg-type]


def test_multibyte_names_that_encode_too_long_are_refused() -> None:
    with pytest.raises(InvalidNameError):
        encode_name("模" * 66)  # 198 bytes raw, 594 encoded


@settings(max_examples=400, deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_encoding_round_trips_or_refuses(name: str) -> None:
    try:
        encoded = encode_name(name)
    except InvalidNameError:
        return
    assert decode_name(encoded) == name
    assert "/" not in encoded and "\x00" not in encoded
    assert encoded not in (".", "..") and not encoded.startswith(".")


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_encoding_is_injective(a: str, b: str) -> None:
    try:
        ea, eb = encode_name(a), encode_name(b)
    except InvalidNameError:
        return
    assert (ea == eb) == (a == b)


@pytest.mark.parametrize("junk", ["a/b", "%zz", "%2f", ".x", "a%2", "é"])
def test_decode_refuses_components_it_did_not_make(junk: str) -> None:
    with pytest.raises(InvalidNameError):
        decode_name(junk)


def test_list_and_drop_models(tmp_path: Path) -> None:
    store = StorageRoot(tmp_path)
    for model in ("meta-llama/Llama-3-8B", "a_b", "a/b"):
        path = store.kv_path(model)
        path.mkdir(parents=True)
        (path / "f").write_bytes(b"x" * 10)
    (tmp_path / "kv" / "not%zzours").mkdir()
    assert store.list_models() == sorted(["meta-llama/Llama-3-8B", "a_b", "a/b"], key=encode_name)
    assert store.model_bytes("a/b") > 0
    assert store.drop_model("a/b") is True
    assert store.drop_model("a/b") is False
    assert "a/b" not in store.list_models() and "a_b" in store.list_models()
