"""The vLLM connector's engine-free parts: its settings, namespaces and keys, and the block
reads that fill vLLM's KV rows (the engine runs are in tests/engines/)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from persisting.errors import ConfigError, CorruptValueError
from persisting.integrations.common.settings import EngineSettings
from persisting.integrations.vllm.blocks import BlockPages, read_rows
from persisting.integrations.vllm.namespace import (
    block_hash_of,
    block_key,
    key_dtype,
    namespace_name,
)
from persisting.integrations.vllm.settings import (
    TIER_MODULE,
    TIER_TYPE,
    ConnectorSettings,
    connector_settings,
    tier_settings,
    tiering_config,
)
from persisting.kv import open_kv_store, parse_key


def test_settings_take_units_and_pass_vllms_keys_through(tmp_path: Path) -> None:
    settings = connector_settings(
        {"storage_path": str(tmp_path), "disk_bytes": "2GiB", "offload_prompt_only": True}
    )
    assert settings.disk_bytes == 2 << 30 and settings.storage_path == tmp_path
    assert settings.durability == "sync" and settings.memory_bytes == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "kv_connector_extra_config needs 'storage_path'"),
        ({"storage_path": "/r", "disk_byte": 1}, "did you mean 'disk_bytes'"),
        ({"storage_path": "/r", "disk_bytes": "lots"}, "disk_bytes must be a size"),
        ({"storage_path": "/r", "durability": "async"}, "needs a memory tier"),
        ({"storage_path": "/r", "eviction": "fifo"}, "eviction must be one of lru, prefix"),
        ({"storage_path": "/r", "io_threads": 0}, "io_threads must be a number >= 1"),
    ],
)
def test_bad_settings_are_refused_by_name(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        connector_settings(extra)


def test_a_tier_entry_takes_persistings_keys_and_says_why_not_the_connectors() -> None:
    settings = tier_settings({"storage_path": "/r", "disk_bytes": "1GiB", "locality": "LOCAL"})
    assert settings.disk_bytes == 1 << 30
    assert (settings.io_threads, settings.fsync) == (16, False)  # a tier's own defaults
    assert tier_settings({"storage_path": "/r", "fsync": True}).fsync
    connector = connector_settings({"storage_path": "/r"})
    assert (connector.io_threads, connector.fsync) == (4, True)
    with pytest.raises(ConfigError, match="did you mean 'disk_bytes'"):
        tier_settings({"storage_path": "/r", "disk_byts": 1})
    with pytest.raises(ConfigError, match="vLLM's CPU tier is the memory in front of this"):
        tier_settings({"storage_path": "/r", "memory_bytes": "1GiB"})


def test_a_gpu_engine_gets_vllms_tiering_spec_with_persisting_behind_its_cpu_tier() -> None:
    extra = {
        "storage_path": "/r",
        "disk_bytes": "2TiB",
        "cpu_bytes": "16GiB",
        "model_version": "v3",
        "offload_prompt_only": False,
        "eviction_policy": "arc",
    }
    config = tiering_config(extra)
    assert config["spec_name"] == "TieringOffloadingSpec"
    assert config["cpu_bytes_to_use"] == 16 << 30
    assert config["offload_prompt_only"] is False and config["eviction_policy"] == "arc"
    (entry,) = config["secondary_tiers"]
    assert entry == {
        "type": TIER_TYPE,
        "module_path": TIER_MODULE,
        "storage_path": "/r",
        "disk_bytes": "2TiB",
        "model_version": "v3",
    }
    assert tier_settings({k: v for k, v in entry.items() if k not in ("type", "module_path")})
    assert tiering_config(config) == config  # the connector is built once per role
    with pytest.raises(ConfigError, match="memory_bytes do not apply"):
        tiering_config({"storage_path": "/r", "memory_bytes": "1GiB"})
    with pytest.raises(ConfigError, match="leave out spec_name"):
        tiering_config({"storage_path": "/r", "spec_name": "CPUOffloadingSpec"})


def test_vllm_0_33_and_0_34_keys_are_passed_to_vllm_not_refused() -> None:
    """``sync_load_budget_bytes`` (the connector's loads waited for within the step) and
    ``tier_poll_interval_s`` (TieringOffloadingSpec's): vLLM's keys since 0.33, passed on
    untouched on either path (vLLM 0.32 ignores them)."""
    extra = {"storage_path": "/r", "sync_load_budget_bytes": 1 << 30, "tier_poll_interval_s": 0.5}
    assert connector_settings(extra).storage_path == Path("/r")
    config = tiering_config(extra)
    assert config["sync_load_budget_bytes"] == 1 << 30 and config["tier_poll_interval_s"] == 0.5
    (entry,) = config["secondary_tiers"]
    assert "sync_load_budget_bytes" not in entry and "tier_poll_interval_s" not in entry


def test_every_layout_field_changes_the_namespace() -> None:
    base = {"dtype": "bfloat16", "groups": [[128, ["l0", "l1"]]], "parallel": [0, 1, 1, 1]}
    names = {namespace_name("org/model", base)}
    for change in (
        {"dtype": "float16"},
        {"groups": [[64, ["l0", "l1"]]]},
        {"parallel": [0, 2, 2, 1]},
        {"hash_algorithm": "sha256_cbor"},
    ):
        names.add(namespace_name("org/model", {**base, **change}))
    names.add(namespace_name("org/other", base))
    assert len(names) == 6
    assert namespace_name("org/model", base) == namespace_name("org/model", dict(base))
    assert namespace_name("org/model", base).startswith("vllm.model.")
    assert namespace_name("org/model", base, prefix="team a").startswith("vllm.team-a.")


def test_block_keys_are_store_keys_and_give_back_the_block_hash() -> None:
    block_hash = bytes(range(32))  # leading zero byte kept
    key = block_key("vllm.m.0123", block_hash, 0, key_dtype("bfloat16"))
    assert parse_key(key).model == "vllm.m.0123"
    assert block_hash_of(key) == (block_hash, 0)
    assert key_dtype("float16") == "half" and key_dtype("weird") == "uint8"


def _caches(layers: int = 3, blocks: int = 8, page: int = 4096, pad: int = 512) -> BlockPages:
    """Byte views like vLLM's: per layer [blocks, padded page], only the page stored."""
    tensors = tuple(np.zeros((blocks, page + pad), dtype=np.int8) for _ in range(layers))
    return BlockPages(tensors, (page,) * layers)


def test_a_stored_block_is_read_straight_into_the_rows(tmp_path: Path) -> None:
    source, target = _caches(), _caches()
    rng = np.random.default_rng(0)
    for tensor in source.tensors:
        tensor[:] = rng.integers(-128, 127, tensor.shape, dtype=np.int8)
    with open_kv_store(tmp_path, "vllm.m.1", memory_bytes=0, disk_bytes=64 << 20) as store:
        value = source.gather(5)
        assert value.shape == (3, 4096)
        (result,) = store.batched_put(["vllm.m.1@1@0@ab@bfloat16"], [value], fmt="binary")
        assert result.stored
        location = store.lease("vllm.m.1@1@0@ab@bfloat16", 10)
        assert location is not None and location.nbytes == source.block_bytes
        read = read_rows(location.path, location.offset, target.rows(2), location.checksum)
    assert read == source.block_bytes
    for src, dst in zip(source.tensors, target.tensors, strict=True):
        assert np.array_equal(src[5, :4096], dst[2, :4096])
        assert not dst[2, 4096:].any() and not dst[5].any()  # padding and other rows untouched


def test_damage_and_a_short_file_are_errors_never_a_load(tmp_path: Path) -> None:
    pages = _caches(layers=2, page=1024, pad=0)
    data = os.urandom(2048)
    path = tmp_path / "block"
    path.write_bytes(b"h" * 16 + data)
    good = xxhash.xxh3_64_intdigest(data)
    assert read_rows(str(path), 16, pages.rows(0), good) == 2048
    with pytest.raises(CorruptValueError, match="checksum"):
        read_rows(str(path), 16, pages.rows(0), good ^ 1)
    path.write_bytes(b"h" * 16 + data[:1500])
    with pytest.raises(CorruptValueError, match="end of file"):
        read_rows(str(path), 16, pages.rows(1), good)


def test_the_shared_keys_are_the_engine_adapters_and_cluster_replaces_storage_path() -> None:
    """The connector's and the tier's settings extend the keys every engine adapter takes
    (``integrations/common``): ``cluster`` in place of ``storage_path``, never both; beside
    it, the keys only a local root serves are refused, saying why."""
    assert ConnectorSettings.__mro__[1] is EngineSettings
    cluster = {"seeds": ["10.0.0.1:8610"]}
    for read in (connector_settings, tier_settings):
        with pytest.raises(ConfigError, match="not both"):
            read({"storage_path": "/r", "cluster": cluster})
        settings = read({"cluster": cluster})
        assert settings.storage_path is None and settings.cluster is not None
    with pytest.raises(ConfigError, match=r"event_topic do not apply with cluster"):
        connector_settings({"cluster": cluster, "event_topic": "kv-events"})
    with pytest.raises(ConfigError, match=r"needs 'storage_path' .* or 'cluster'"):
        tier_settings({"disk_bytes": "1GiB"})
    with pytest.raises(ConfigError, match="'memory_bytes' does not apply here"):
        tier_settings({"storage_path": "/r", "memory_bytes": "1GiB"})
