"""Settings shared by the CLI, the actor service and the LMCache plugin.

One :class:`PersistingSettings` object is read from (highest priority first) keyword
arguments, ``PERSISTING_*`` environment variables (nested sections with ``__``, e.g.
``PERSISTING_KV__MEMORY_BYTES``), a TOML file named by ``PERSISTING_CONFIG`` or passed to
:meth:`PersistingSettings.from_toml`, and the defaults below.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from persisting.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20

KVDurability = Literal["sync", "async", "write_back"]
#: Earlier names of durability modes, still accepted.
DURABILITY_ALIASES = {"evict": "write_back"}
QueueDurability = Literal["wal", "flush"]


class KVSettings(BaseModel):
    """The KV-cache store: tier budgets, completion mode and policies."""

    memory_bytes: int = Field(default=2 * GiB, ge=0)
    disk_bytes: int = Field(default=64 * GiB, ge=0)
    durability: KVDurability = "sync"
    chunk_size: int = Field(default=256, gt=0)
    max_value_bytes: int = Field(default=1 * GiB, gt=0)
    eviction: Literal["lru", "prefix"] = "lru"
    admission: Literal["always", "second_sighting"] = "always"
    #: Pages reused for the values ``get`` returns (in-process); 0: a fresh array each time.
    result_buffer_bytes: int = Field(default=256 * MiB, ge=0)

    @field_validator("durability", mode="before")
    @classmethod
    def _old_durability_names(cls, value: Any) -> Any:
        return DURABILITY_ALIASES.get(value, value) if isinstance(value, str) else value


class QueueSettings(BaseModel):
    """The Lance queue backend: batching, durability and background maintenance."""

    batch_size: int = Field(default=100, gt=0)
    durability: QueueDurability = "wal"
    fsync_interval_ms: float = Field(default=0.0, ge=0)
    flush_interval_s: float = Field(default=1.0, ge=0)
    compact_max_fragments: int = Field(default=32, gt=1)
    retention_s: float | None = Field(default=None, gt=0)
    retain_until_consumed: bool = False
    version_retention_s: float = Field(default=10.0, ge=0)


class ServiceSettings(BaseModel):
    """The Pulsing actor service and its client."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "kvstore"
    addr: str = "127.0.0.1:8610"
    seeds: list[str] = Field(default_factory=list)
    #: Pulsing cluster passphrase (TLS). Unset: a server generates one, kept in
    #: ``passphrase_file``, and serves loopback only (see persisting.service.passphrase).
    passphrase: str | None = None
    #: Where a generated passphrase is kept (default: $XDG_STATE_HOME/persisting/passphrase).
    passphrase_file: Path | None = None
    max_inflight: int = Field(default=16, gt=0, le=16)
    lease_ttl_s: float = Field(default=30.0, gt=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    event_topic: str = "kv-events"
    #: Largest payload part one message carries on the message path (remote clients).
    #: ``message_chunk_bytes`` is its earlier name, still accepted.
    message_part_bytes: int = Field(
        default=4 * MiB,
        gt=0,
        validation_alias=AliasChoices("message_part_bytes", "message_chunk_bytes"),
    )
    request_timeout_s: float = Field(default=30.0, gt=0)
    lanes: int = Field(default=4, gt=0, le=16)
    shm_arena_bytes: int = Field(default=256 * MiB, ge=0)
    #: Keep the memory tier in shared memory, so same-host clients copy hits out themselves.
    shared_memory_tier: bool = True
    member_retry_s: float = Field(default=2.0, gt=0)
    discovery_timeout_s: float = Field(default=10.0, gt=0)
    event_batch_records: int = Field(default=64, gt=0)
    #: The server's log: level (debug, info, warning, error) and format (text or json).
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class PersistingSettings(BaseSettings):
    """Everything a Persisting process needs to know, from env, TOML or arguments."""

    model_config = SettingsConfigDict(
        env_prefix="PERSISTING_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    storage_path: Path = Path("./persisting-data")
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    kv: KVSettings = Field(default_factory=KVSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    service: ServiceSettings = Field(default_factory=ServiceSettings)

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value: Any) -> Any:
        # PERSISTING_MODELS=a/b,c/d is the natural shell form; JSON lists work too.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                import json

                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _TOML_FILE.get() or os.environ.get("PERSISTING_CONFIG")
        if toml_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    @classmethod
    def load(cls, toml_file: str | Path | None = None, **overrides: Any) -> PersistingSettings:
        """Settings from a TOML file (if given; else ``PERSISTING_CONFIG``), the environment
        and ``overrides``. Invalid settings raise :class:`~persisting.errors.ConfigError`."""
        if toml_file is not None and not Path(toml_file).is_file():
            raise ConfigError(f"settings file not found: {toml_file}")
        token = _TOML_FILE.set(str(toml_file) if toml_file is not None else None)
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise ConfigError(str(exc)) from exc
        finally:
            _TOML_FILE.reset(token)

    from_toml = load


#: The TOML file of the :meth:`PersistingSettings.load` call in progress (below env).
_TOML_FILE: ContextVar[str | None] = ContextVar("persisting_toml_file", default=None)


__all__ = [
    "DURABILITY_ALIASES",
    "KVSettings",
    "PersistingSettings",
    "QueueSettings",
    "ServiceSettings",
]
