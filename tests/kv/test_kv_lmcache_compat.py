"""What the LMCache plugin needs from the KV layer: foreign layouts, cheap repeated key checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from persisting.errors import InvalidValueError
from persisting.kv import MEMORY_FORMATS, Layout, open_kv_store

MODEL = "meta-llama/Llama-3-8B"
KEY = f"{MODEL}@1@0@-2a@bfloat16"


def test_every_lmcache_memory_format_name_is_known() -> None:
    lmcache_names = {
        "UNDEFINED", "KV_2LTD", "KV_T2D", "KV_2TD", "BINARY", "BINARY_BUFFER",
        "KV_MLA_FMT", "EC_TD", "HS_TD",
    }  # fmt: skip
    assert lmcache_names <= set(MEMORY_FORMATS)


def test_check_shape_false_keeps_a_foreign_layout_exactly(root: Path) -> None:
    # LMCache's own tests and I/O benchmark label [2, 16, 8, 128] blobs KV_T2D.
    value = torch.arange(2 * 16 * 8 * 128, dtype=torch.float32).to(torch.bfloat16)
    value = value.reshape(2, 16, 8, 128)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 26) as store:
        with pytest.raises(InvalidValueError):
            store.put(KEY, value, fmt="KV_T2D")
        assert not store.contains(KEY)
        result = store.put(KEY, value, fmt="KV_T2D", check_shape=False)
        assert result.stored and result.durable
        want = Layout((2, 16, 8, 128), "bfloat16", "KV_T2D", value.numel() * 2)
        assert store.layout(KEY) == want
        assert torch.equal(store.get(KEY, expect=want), value)
        with pytest.raises(InvalidValueError):  # an unknown name is still refused
            store.put(KEY.replace("-2a", "-2b"), value, fmt="KV_9D", check_shape=False)


def test_key_strings_are_validated_every_time_even_when_remembered() -> None:
    from persisting.errors import InvalidKeyError
    from persisting.kv import key_string

    good = f"{MODEL}@2@1@-7f@half@7@t%v"
    assert key_string(good) is good and key_string(good) is good  # verbatim, cached
    for bad in (f"{MODEL}@2@-2@1f@half", f"{MODEL}@1@0@xyz@half", "short@1"):
        for _ in range(2):
            with pytest.raises(InvalidKeyError):
                key_string(bad)
    with pytest.raises(InvalidKeyError):
        key_string(12345)
