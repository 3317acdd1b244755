"""ChunkKey string format (LMCache's) and deterministic, prefix-chained token hashing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from persisting.errors import InvalidKeyError
from persisting.kv import ChunkKey, LayerChunkKey, TokenHasher, key_string, parse_key
from persisting.kv.keys import KEY_DTYPES, key_hash, rank_keys
from persisting.kv.layout import MEMORY_FORMATS, Layout, token_count


def test_string_format_matches_lmcache() -> None:
    k = ChunkKey("meta-llama/Llama-3-8B", 4, 2, -0x1F, "half", (("lora", "v2"), ("tenant", "a")))
    assert str(k) == "meta-llama/Llama-3-8B@4@2@-1f@half@lora%v2@tenant%a"
    lk = k.split_layers(3)[2]
    assert str(lk) == "meta-llama/Llama-3-8B@4@2@-1f@half@2@lora%v2@tenant%a"
    assert isinstance(parse_key(str(lk)), LayerChunkKey)
    assert parse_key(str(lk)).chunk() == k


@given(
    world=st.integers(1, 64),
    data=st.data(),
    h=st.integers(-(1 << 80), 1 << 80),
    dtype=st.sampled_from(sorted(KEY_DTYPES)),
    tags=st.lists(
        st.tuples(
            st.text(
                st.characters(blacklist_characters="@%", blacklist_categories=("Cc", "Cs")),
                min_size=1,
                max_size=8,
            ),
            st.text(
                st.characters(blacklist_characters="@", blacklist_categories=("Cc", "Cs")),
                max_size=8,
            ),
        ),
        max_size=3,
    ),
    layer=st.none() | st.integers(0, 200),
)
def test_round_trip_is_lossless(world, data, h, dtype, tags, layer) -> None:
    worker = data.draw(st.integers(0, world - 1))
    if layer is None:
        k = ChunkKey("Qwen/Qwen2.5-7B", world, worker, h, dtype, tuple(tags))
    else:
        k = LayerChunkKey("Qwen/Qwen2.5-7B", world, worker, h, dtype, tuple(tags), layer_id=layer)
    text = k.to_string()
    back = parse_key(text)
    assert back == k and type(back) is type(k)
    assert back.to_string() == text


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "model",
        "m@1@0@ff",
        "m@x@0@ff@half",
        "m@1@0@zz@half",
        "m@1@0@ff@float128",
        "m@1@-1@ff@half",  # negative worker
        "m@0@0@ff@half",
        "m@1@0@ff@half@notag",
        "m@1@0@@half",
        "m@1@0@--1@half",
        "a" * 2000 + "@1@0@1@half",
    ],
)
def test_malformed_keys_raise_invalid_key(bad: str) -> None:
    with pytest.raises(InvalidKeyError):
        parse_key(bad)
    with pytest.raises(InvalidKeyError):
        key_string(bad)


def test_non_string_keys_are_refused() -> None:
    for bad in (None, 5, b"m@1@0@1@half", ["m"]):
        with pytest.raises(InvalidKeyError):
            parse_key(bad)


def test_hasher_chunks_and_chains() -> None:
    h = TokenHasher("m", chunk_size=4)
    a = h.process_tokens(list(range(10)))
    assert [(s, e) for s, e, _ in a] == [(0, 4), (4, 8)]
    b = h.process_tokens([*range(8), 99, 98])
    assert [k for *_, k in a] == [k for *_, k in b]  # same prefix, same keys
    c = h.process_tokens([1000, *range(1, 8)])
    assert all(x[2] != y[2] for x, y in zip(a, c, strict=True))  # first token changes all
    d = h.process_tokens([0, 1, 2, 3, 5, 5, 6, 7])
    assert d[0][2] == a[0][2] and d[1][2] != a[1][2]
    partial = TokenHasher("m", chunk_size=4, save_unfull_chunk=True).process_tokens(range(10))
    assert [(s, e) for s, e, _ in partial] == [(0, 4), (4, 8), (8, 10)]
    assert TokenHasher("other", chunk_size=4).process_tokens(range(4))[0][2] != a[0][2]


def test_hasher_is_deterministic_across_processes() -> None:
    code = (
        "from persisting.kv import TokenHasher;"
        "print([str(k) for *_, k in TokenHasher('m', chunk_size=8, world_size=2, worker_id=1)"
        ".process_tokens(range(50))])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    here = str(
        [
            str(k)
            for *_, k in TokenHasher("m", chunk_size=8, world_size=2, worker_id=1).process_tokens(
                range(50)
            )
        ]
    )
    assert outs.pop().strip() == here


def test_hasher_validates_its_settings() -> None:
    for kwargs in ({"chunk_size": 0}, {"dtype": "float128"}, {"worker_id": -1}):
        with pytest.raises(InvalidKeyError):
            TokenHasher("m", **kwargs)


def test_rank_keys_keep_the_string_and_change_the_worker() -> None:
    """The eviction policy's sibling ranks come from the key format's own module: the
    string verbatim (a hash written with leading zeros stays so), one per worker."""
    assert rank_keys("m@2@1@00ab@half@lora%v") == [
        "m@2@0@00ab@half@lora%v",
        "m@2@1@00ab@half@lora%v",
    ]
    assert rank_keys("m@1@0@ab@half") == []
    assert rank_keys("not a key") == []


def test_one_key_hash_never_zero() -> None:
    assert key_hash("m@1@0@ab@half") == key_hash("m@1@0@ab@half") != 0


def test_token_count_follows_each_formats_token_axis() -> None:
    """One table says each format's shape rule and token axis (the policy's miss cost)."""
    shapes = {"KV_2LTD": (2, 4, 16, 8), "KV_2TD": (2, 16, 8), "KV_T2D": (16, 2, 8)}
    for fmt, shape in shapes.items():
        assert token_count(Layout(shape, "half", fmt, 2 * 16 * 64)) == 16
    assert token_count(Layout((4, 16, 8), "half", "KV_MLA_FMT", 1024)) == 16
    assert token_count(Layout((100,), "uint8", "binary", 100, "bytes")) == 1
    assert all(
        rule.token_axis is None for f, rule in MEMORY_FORMATS.items() if "BINARY" in f.upper()
    )
