"""Settings load from env, TOML and arguments; errors form one hierarchy."""

from __future__ import annotations

from pathlib import Path

import pytest

from persisting import errors
from persisting.config import PersistingSettings
from persisting.errors import ConfigError, PersistingError


def test_defaults_are_usable() -> None:
    s = PersistingSettings()
    assert s.kv.durability == "sync"
    assert s.queue.durability == "wal"
    assert s.service.max_inflight <= 16


def test_env_with_prefix_and_nested_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSISTING_STORAGE_PATH", "/tmp/x")
    monkeypatch.setenv("PERSISTING_MODELS", "meta-llama/Llama-3-8B, Qwen/Qwen2-7B")
    monkeypatch.setenv("PERSISTING_KV__MEMORY_BYTES", "1024")
    monkeypatch.setenv("PERSISTING_SERVICE__PASSPHRASE", "s3cret")
    s = PersistingSettings()
    assert s.storage_path == Path("/tmp/x")
    assert s.models == ["meta-llama/Llama-3-8B", "Qwen/Qwen2-7B"]
    assert s.kv.memory_bytes == 1024
    assert s.service.passphrase == "s3cret"


def test_toml_file_below_env_and_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        'storage_path = "/data/p"\nmodels = ["m1"]\n'
        '[kv]\nmemory_bytes = 77\ndurability = "async"\n[queue]\nbatch_size = 5\n'
    )
    s = PersistingSettings.from_toml(cfg)
    assert (s.storage_path, s.models, s.kv.memory_bytes, s.kv.durability) == (
        Path("/data/p"),
        ["m1"],
        77,
        "async",
    )
    assert s.queue.batch_size == 5
    monkeypatch.setenv("PERSISTING_KV__MEMORY_BYTES", "88")
    assert PersistingSettings.from_toml(cfg).kv.memory_bytes == 88
    assert PersistingSettings.from_toml(cfg, models=["m2"]).models == ["m2"]
    monkeypatch.setenv("PERSISTING_CONFIG", str(cfg))
    assert PersistingSettings().queue.batch_size == 5


def test_bad_settings_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        PersistingSettings.load(kv={"durability": "sometimes"})
    with pytest.raises(ConfigError):
        PersistingSettings.load(tmp_path / "missing.toml")


def test_every_error_is_a_persisting_error_with_a_unique_code() -> None:
    classes = [getattr(errors, n) for n in errors.__all__ if n.endswith("Error")]
    codes = [c.code for c in classes]
    assert len(set(codes)) == len(codes)
    for cls in classes:
        assert issubclass(cls, PersistingError)
        assert errors.error_class_for(cls.code) is cls
    assert errors.error_class_for("no-such-code") is PersistingError
