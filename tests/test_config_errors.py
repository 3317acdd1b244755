"""Settings load from env, TOML and arguments; errors form one hierarchy."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import tomllib

from persisting import errors
from persisting.cli.config_sample import sample_toml
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


# --- mistakes are refused, naming the key and the closest valid one -------------------------

REPO = Path(__file__).resolve().parents[1]


TOML_MISTAKES = [
    ("[kv]\nmemory_byte = 5\n", "unknown setting kv.memory_byte in {file}; did you mean"),
    ('[servce]\naddr = "127.0.0.1:1"\n', "unknown setting servce in {file}; did you mean"),
    ('storage_pth = "/x"\n', "unknown setting storage_pth in {file}; did you mean"),
    ("[kv\nmemory_bytes = 5\n", "{file} is not valid TOML"),
    ('[kv]\ndurability = "often"\n', "kv.durability: Input should be 'sync', 'async' or"),
    ('[kv]\ndisk_bytes = "12XB"\n', "kv.disk_bytes: could not interpret byte unit: XB"),
]
CLOSEST = ["kv.memory_bytes?", "service?", "storage_path?", "", "(got 'often' from {file})", ""]


@pytest.mark.parametrize(
    ("toml", "message", "closest"), [(*m, c) for m, c in zip(TOML_MISTAKES, CLOSEST, strict=True)]
)
def test_toml_mistakes_name_the_key_and_the_file(
    tmp_path: Path, toml: str, message: str, closest: str
) -> None:
    cfg = tmp_path / "persisting.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as info:
        PersistingSettings.load(cfg)
    assert message.format(file=cfg) in str(info.value)
    assert closest.format(file=cfg) in str(info.value)
    assert "\n" not in str(info.value)  # one line, for the command line and for logs


@pytest.mark.parametrize(
    ("variable", "message"),
    [
        ("PERSISTING_KV__MEMORY_BYTE", "did you mean PERSISTING_KV__MEMORY_BYTES?"),
        ("PERSISTING_SERVCE__ADDR", "did you mean PERSISTING_SERVICE__ADDR?"),
        ("PERSISTING_STORAGE_PAHT", "did you mean PERSISTING_STORAGE_PATH?"),
    ],
)
def test_unknown_environment_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, message: str
) -> None:
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ConfigError) as info:
        PersistingSettings()
    assert f"unknown setting {variable} in the environment; {message}" == str(info.value)


def test_variables_that_are_not_settings_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSISTING_SKIP_LMCACHE", "1")  # scripts/install.sh reads it
    monkeypatch.setenv("PERSISTING_BUILD_LABEL", "nightly")  # nothing like any setting
    assert PersistingSettings().kv.durability == "sync"


def test_a_missing_or_broken_settings_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSISTING_CONFIG", str(tmp_path / "typo.toml"))
    with pytest.raises(ConfigError, match=r"typo\.toml \(named by PERSISTING_CONFIG\)"):
        PersistingSettings()
    monkeypatch.delenv("PERSISTING_CONFIG")
    with pytest.raises(ConfigError, match=r"invalid settings: kv\.durability"):
        PersistingSettings(kv={"durability": "sometimes"})  # the constructor too


def test_sizes_take_units_everywhere_and_stay_plain_ints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text('[kv]\nmemory_bytes = "8GiB"\ndisk_bytes = "512MB"\n')
    monkeypatch.setenv("PERSISTING_SERVICE__STAGING_BYTES", "16MiB")
    s = PersistingSettings.load(cfg, kv={"max_value_bytes": "1.5GiB"})
    assert s.kv.memory_bytes == 8 << 30 and s.kv.disk_bytes == 512_000_000
    assert s.service.staging_bytes == 16 << 20 and s.kv.max_value_bytes == 3 << 29
    # Plain ints: settings travel in service messages that refuse every class but builtins.
    from persisting.service.protocol import safe_loads

    for value in (s.kv.memory_bytes, s.service.staging_bytes, s.kv.max_value_bytes):
        assert type(value) is int
    assert safe_loads(pickle.dumps(s.model_dump(mode="python")["kv"]))["memory_bytes"] == 8 << 30


def test_service_addresses_are_ip_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSISTING_SERVICE__ADDR", "localhost:8610")
    with pytest.raises(ConfigError, match=r"a host name is not resolved: use 127\.0\.0\.1"):
        PersistingSettings()
    monkeypatch.setenv("PERSISTING_SERVICE__ADDR", "[::1]:8610")
    assert PersistingSettings().service.addr == "[::1]:8610"
    with pytest.raises(ConfigError, match="the port must be 0 to 65535"):
        PersistingSettings(service={"seeds": ["10.0.0.1:99999"]})


def test_the_sample_settings_file_is_generated_and_in_sync() -> None:
    committed = (REPO / "deploy" / "persisting.toml").read_text()
    assert committed == sample_toml(), "run: persisting config sample > deploy/persisting.toml"
    data = tomllib.loads(committed)
    defaults = PersistingSettings.model_construct()
    for section in ("kv", "queue", "service"):
        model = getattr(defaults, section)
        assert set(data[section]) | _unset(committed, section) == set(type(model).model_fields)
    loaded = PersistingSettings.load(REPO / "deploy" / "persisting.toml")
    assert loaded.model_dump() == PersistingSettings.model_construct().model_dump()


def _unset(text: str, section: str) -> set[str]:
    """Settings a section lists commented out (their default is unset)."""
    body = text.split(f"[{section}]", 1)[1].split("\n[", 1)[0]
    return {line[2:].split(" =")[0] for line in body.splitlines() if line.endswith(" =")}
