"""The plugin's settings: extra_config ``persisting.*`` over TOML, environment and defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from persisting.errors import ConfigError
from persisting.lmcache_backend import settings_from_extra_config
from tests.lmcache.lmcache_harness import (
    filled,
    key,
    make_config,
    plugin_of,
    same_bytes,
    storage_manager,
)


def test_extra_config_keys_override_the_store_settings(tmp_path: Path) -> None:
    settings, options = settings_from_extra_config(
        {
            "persisting.storage_path": str(tmp_path),
            "persisting.memory_bytes": "1048576",  # YAML and env give strings
            "persisting.kv.disk_bytes": 1 << 30,
            "persisting.durability": "sync",
            "persisting.eviction": "prefix",
            "persisting.io_threads": 2,
            "storage_plugin.PersistingBackend.module_path": "ignored: not ours",
            "use_odirect": True,
        },
        chunk_size=128,
    )
    assert settings.storage_path == tmp_path
    assert settings.kv.memory_bytes == 1 << 20 and settings.kv.disk_bytes == 1 << 30
    assert settings.kv.durability == "sync" and settings.kv.eviction == "prefix"
    assert settings.kv.chunk_size == 128  # LMCache's chunk size
    assert options.io_threads == 2


def test_environment_and_toml_are_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "persisting.toml"
    toml.write_text('storage_path = "/from/toml"\n[kv]\ndisk_bytes = 123456789\n')
    monkeypatch.setenv("PERSISTING_KV__MEMORY_BYTES", "4096")
    settings, _ = settings_from_extra_config({"persisting.config": str(toml)})
    assert settings.storage_path == Path("/from/toml")
    assert settings.kv.disk_bytes == 123456789 and settings.kv.memory_bytes == 4096
    monkeypatch.setenv("PERSISTING_STORAGE_PATH", str(tmp_path / "env"))
    settings, _ = settings_from_extra_config(None)
    assert settings.storage_path == tmp_path / "env"


def test_puts_complete_write_behind_unless_durability_is_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert settings_from_extra_config({})[0].kv.durability == "async"
    # Without a memory tier there is nothing to write behind from.
    assert settings_from_extra_config({"persisting.memory_bytes": 0})[0].kv.durability == "sync"
    monkeypatch.setenv("PERSISTING_KV__DURABILITY", "sync")
    assert settings_from_extra_config({})[0].kv.durability == "sync"
    assert settings_from_extra_config({"persisting.durability": "write_back"})[0].kv.durability == (
        "write_back"
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"persisting.no_such_thing": 1},
        {"persisting.kv.storage_path": "/x"},
        {"persisting.memory_bytes": -1},
        {"persisting.durability": "sometimes"},
        {"persisting.durability": "evict"},
        {"persisting.io_threads": 0},
        {"persisting.io_threads": "many"},
        {"persisting.prefault_memory": "sometimes"},
        {"persisting.prefault_memory": 2},
        {"persisting.config": "/no/such/file.toml"},
    ],
)
def test_bad_settings_are_config_errors(extra: dict) -> None:
    with pytest.raises(ConfigError):
        settings_from_extra_config(extra)


def test_the_plugin_reads_its_settings_from_the_lmcache_config(root: Path) -> None:
    config = make_config(root, durability="sync", memory_bytes=0, io_threads=1)
    with storage_manager(config) as manager:
        plugin = plugin_of(manager)
        assert plugin.options.io_threads == 1
        store = plugin.stats()["stores"]
        assert list(store) == ["meta-llama/Llama-3-8B"]
        (only,) = store.values()
        assert only["durability"] == "sync" and only["memory_capacity"] == 0


@pytest.mark.parametrize(
    ("written", "size"),
    [
        ("64GiB", 64 << 30),
        ("512MB", 512 * 10**6),
        ("1.5GiB", 3 << 29),
        ("16 MiB", 16 << 20),
        ("4096", 4096),
        (4096, 4096),
        ("8gb", 8 * 10**9),
    ],
)
def test_sizes_accept_units(written: object, size: int) -> None:
    extra = {f"persisting.{name}": written for name in ("memory_bytes", "disk_bytes")}
    extra["persisting.kv.max_value_bytes"] = written
    extra["persisting.result_buffer_bytes"] = written
    settings, _ = settings_from_extra_config(extra)
    kv = settings.kv
    assert (kv.memory_bytes, kv.disk_bytes, kv.max_value_bytes, kv.result_buffer_bytes) == (
        size,
        size,
        size,
        size,
    )


@pytest.mark.parametrize("written", ["64 potatoes", "-1GiB", -1, 1.5, True, "GiB", [1]])
def test_a_bad_size_names_the_key(written: object) -> None:
    with pytest.raises(ConfigError, match=r"persisting\.disk_bytes"):
        settings_from_extra_config({"persisting.disk_bytes": written})


def test_the_lmcache_config_may_size_the_plugin_in_gib(root: Path) -> None:
    config = make_config(root, disk_bytes="1GiB", memory_bytes="8MiB")
    with storage_manager(config) as manager:
        (store,) = plugin_of(manager).stats()["stores"].values()
        assert store["disk_capacity"] == 1 << 30 and store["memory_capacity"] == 8 << 20


@pytest.mark.parametrize(
    ("written", "on"), [(None, True), (True, True), ("false", False), ("on", True), (False, False)]
)
def test_prefault_memory_is_on_unless_turned_off(written: object, on: bool) -> None:
    extra = {} if written is None else {"persisting.prefault_memory": written}
    assert settings_from_extra_config(extra)[1].prefault_memory is on


def test_the_plugin_prefaults_each_store_s_memory_tier_unless_told_not_to(root: Path) -> None:
    with storage_manager(make_config(root, memory_bytes="8MiB")) as manager:
        plugin = plugin_of(manager)
        keys = [key(i) for i in range(3)]
        objs = [filled(manager, i) for i in range(3)]
        want = [obj.tensor.clone() for obj in objs]
        manager.batched_put(keys, objs)  # puts racing the prefault: it never changes a page
        store = plugin.store_for(keys[0])
        assert store.prefaulted_bytes(wait=True) == 8 << 20
        plugin.flush()
        for k, w in zip(keys, want, strict=True):
            got = plugin.get_blocking(k)
            assert got is not None and same_bytes(got.tensor, w)
            got.ref_count_down()
    with storage_manager(make_config(root / "off", prefault_memory=False)) as manager:
        store = plugin_of(manager).store_for(key(0))
        assert store.prefaulted_bytes() == 0
