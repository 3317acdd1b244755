"""The value policy is the default, and every eviction policy is selectable, in every kind
of deployment: the library, the service's settings, the LMCache plugin and L2 adapter, and
the vLLM connector and the SGLang HiCache backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from persisting.config import KVSettings, PersistingSettings
from persisting.errors import ConfigError
from persisting.integrations.lmcache.settings import l2_params, settings_from_extra_config
from persisting.integrations.sglang.settings import storage_settings
from persisting.integrations.vllm.settings import connector_settings
from persisting.kv import open_kv_store
from persisting.kv.eviction.policy import LRUEviction, PrefixAwareEviction, ValueEviction
from persisting.kv.eviction.reuse import FILE_NAME
from tests.kv.kv_helpers import disk_tier, memory_tier

POLICIES = {"value": ValueEviction, "lru": LRUEviction, "prefix": PrefixAwareEviction}


def test_the_default_is_value_everywhere(tmp_path: Path) -> None:
    assert KVSettings().eviction == "value"
    assert connector_settings({"storage_path": str(tmp_path)}).eviction == "value"
    assert storage_settings({"storage_path": str(tmp_path)}).eviction == "value"
    assert l2_params({"storage_path": str(tmp_path)}).eviction == "value"
    settings, _options = settings_from_extra_config({"persisting.storage_path": str(tmp_path)})
    assert settings.kv.eviction == "value"
    with open_kv_store(tmp_path / "root", "m", memory_bytes=1 << 20, disk_bytes=16 << 20) as s:
        assert isinstance(disk_tier(s).policy, ValueEviction)
        assert isinstance(memory_tier(s).policy, ValueEviction)  # both tiers
        assert (disk_tier(s).directory / FILE_NAME).is_file()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_policy_is_selectable_everywhere(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert connector_settings({"storage_path": str(tmp_path), "eviction": name}).eviction == name
    assert storage_settings({"storage_path": str(tmp_path), "eviction": name}).eviction == name
    assert l2_params({"storage_path": str(tmp_path), "eviction": name}).eviction == name
    settings, _options = settings_from_extra_config(
        {"persisting.storage_path": str(tmp_path), "persisting.eviction": name}
    )
    assert settings.kv.eviction == name
    monkeypatch.setenv("PERSISTING_KV__EVICTION", name)  # the service reads its settings
    assert PersistingSettings().kv.eviction == name
    root = tmp_path / "root"
    with open_kv_store(root, "m", memory_bytes=0, disk_bytes=16 << 20, eviction=name) as s:
        assert type(disk_tier(s).policy) is POLICIES[name]
        # only the value policy keeps the shared reuse counts
        assert (disk_tier(s).directory / FILE_NAME).exists() == (name == "value")


def test_an_unknown_policy_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lru, prefix or value"):
        connector_settings({"storage_path": str(tmp_path), "eviction": "fifo"})
    with pytest.raises(ConfigError, match="lru, prefix or value"):
        l2_params({"storage_path": str(tmp_path), "eviction": "fifo"})
    with pytest.raises(ConfigError, match="eviction"):
        PersistingSettings.load(None, kv={"eviction": "fifo"})
    with pytest.raises(ConfigError, match="unknown eviction policy 'fifo'"):
        open_kv_store(tmp_path / "root", "m", memory_bytes=1 << 20, disk_bytes=0, eviction="fifo")
