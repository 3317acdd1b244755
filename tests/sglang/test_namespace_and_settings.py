"""The backend's settings and namespace, without SGLang: what keeps incompatible KV apart,
and what a typo in the extra config gets."""

from __future__ import annotations

import dataclasses

import pytest

from persisting.errors import ConfigError
from persisting.integrations.sglang.namespace import PageKeys, PageShape, Shard, namespace_name
from persisting.integrations.sglang.settings import storage_settings
from persisting.kv import parse_key

SHAPE = PageShape("MHATokenToKVPoolHost", "page_first", 64, "bfloat16", (4 << 20, 4 << 20))
WEIGHTS = {"weights": "version:1"}
HASH = "ab" * 32


def _ns(shape=SHAPE, shard=Shard(), weights=WEIGHTS, model="meta-llama/Llama-3-8B") -> str:
    return namespace_name(model, weights, shape, shard)


def test_everything_that_makes_kv_incompatible_is_another_namespace() -> None:
    base = _ns()
    assert base.startswith("sglang.Llama-3-8B.")
    others = {
        _ns(model="meta-llama/Llama-3-70B"),
        _ns(weights={"weights": "version:2"}),
        _ns(shape=dataclasses.replace(SHAPE, page_size=32)),
        _ns(shape=dataclasses.replace(SHAPE, dtype="float16")),
        _ns(shape=dataclasses.replace(SHAPE, layout="layer_first")),
        _ns(shape=dataclasses.replace(SHAPE, pool="MLATokenToKVPoolHost")),
        _ns(shape=dataclasses.replace(SHAPE, part_bytes=(1 << 20,) * 2)),
        _ns(shape=dataclasses.replace(SHAPE, geometry={"layer_num": 32})),
        _ns(shard=Shard(tp_size=2)),
        _ns(shard=Shard(pp_size=2)),
        _ns(shard=Shard(cp_size=2)),
        _ns(shard=Shard(replicated=True)),
    }
    assert base not in others and len(others) == 12


def test_ranks_are_in_the_key_and_mla_pages_are_one_copy_for_all_ranks() -> None:
    rank0, rank1 = Shard(tp_rank=0, tp_size=2), Shard(tp_rank=1, tp_size=2)
    assert _ns(shard=rank0) == _ns(shard=rank1)  # one namespace, one budget
    k0 = PageKeys(_ns(shard=rank0), SHAPE, rank0).key(HASH)
    k1 = PageKeys(_ns(shard=rank1), SHAPE, rank1).key(HASH)
    assert k0 != k1
    assert (parse_key(k1).world_size, parse_key(k1).worker_id) == (2, 1)
    mla0, mla1 = (
        Shard(tp_rank=0, tp_size=4, replicated=True),
        Shard(tp_rank=3, tp_size=4, replicated=True),
    )
    assert _ns(shard=mla0) == _ns(shard=Shard(tp_size=8, replicated=True))
    assert PageKeys("ns", SHAPE, mla0).key(HASH) == PageKeys("ns", SHAPE, mla1).key(HASH)
    pp = PageKeys("ns", SHAPE, Shard(pp_rank=1, pp_size=2)).key(HASH)
    assert pp.endswith("@pp%1") and parse_key(pp).chunk_hash == int(HASH, 16)


def test_any_page_name_makes_a_valid_key() -> None:
    keys = PageKeys("ns", SHAPE, Shard())
    odd = keys.key("page-7_kv@x")
    assert parse_key(odd).model == "ns" and odd != keys.key("page-7_kv@y")
    assert keys.key(HASH) == f"ns@1@0@{HASH}@bfloat16"


def test_settings_take_units_and_refuse_unknown_keys_with_the_closest() -> None:
    s = storage_settings({"storage_path": "/srv/p", "disk_bytes": "2GiB", "interface_v1": 1})
    assert s.disk_bytes == 2 << 30 and str(s.storage_path) == "/srv/p" and s.fsync is False
    with pytest.raises(ConfigError, match=r"'storage_pth' \(did you mean 'storage_path'\?\)"):
        storage_settings({"storage_pth": "/srv/p"})
    with pytest.raises(ConfigError, match="needs storage_path"):
        storage_settings({"backend_name": "persisting"})
    with pytest.raises(ConfigError, match="size"):
        storage_settings({"storage_path": "/p", "disk_bytes": "lots"})
    with pytest.raises(ConfigError, match="eviction"):
        storage_settings({"storage_path": "/p", "eviction": "random"})
