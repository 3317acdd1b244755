"""The configurations docs/lmcache.md shows load as written (with a test storage root)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

from persisting.integrations.lmcache import PersistingL2Adapter, settings_from_extra_config
from persisting.integrations.lmcache.settings import l2_params
from tests.lmcache.l2_harness import l2_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "lmcache.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_in_process_yaml_configures_the_plugin(tmp_path: Path) -> None:
    (text,) = [b for b in blocks("yaml") if "storage_plugins:" in b]
    config = yaml.safe_load(text)
    assert config["storage_plugins"] == ["PersistingBackend"]
    extra = {**config["extra_config"], "persisting.storage_path": str(tmp_path)}
    assert extra["storage_plugin.PersistingBackend.module_path"] == "persisting.lmcache_backend"
    settings, _options = settings_from_extra_config(extra)
    assert settings.kv.disk_bytes == 500 << 30


def test_the_cluster_key_blocks_read_as_settings() -> None:
    (plugin,) = [b for b in blocks("yaml") if "persisting.cluster" in b]
    extra = yaml.safe_load(plugin)["extra_config"]
    _settings, options = settings_from_extra_config(extra)
    assert options.cluster is not None and options.cluster.seeds == ["10.0.0.5:8610"]
    (adapter,) = [b for b in blocks("json") if '"cluster"' in b]
    params = l2_params(json.loads("{" + adapter + "}")["adapter_params"])
    assert params.cluster is not None and params.namespace == "lmcache"


def test_the_l2_adapter_json_builds_the_adapter_through_lmcache(tmp_path: Path) -> None:
    (text,) = [b for b in blocks("json") if '"type": "plugin"' in b]
    entry = json.loads(text)
    entry["adapter_params"]["storage_path"] = str(tmp_path)
    (config,) = l2_config(entry).adapters
    adapter = create_l2_adapter_from_registry(config)
    try:
        assert isinstance(adapter, PersistingL2Adapter)
        assert adapter.params.capacity == 500 << 30 and adapter.params.durability == "sync"
    finally:
        adapter.close()
