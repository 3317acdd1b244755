"""The options a LanceBackend accepts, validated in one place.

Pulsing passes ``backend_options`` as keyword arguments, so a typo must be an error rather
than a silently ignored setting. Defaults come from :class:`~persisting.config.QueueSettings`
as loaded by :class:`~persisting.config.PersistingSettings` (``PERSISTING_QUEUE__*``, TOML),
so a whole cluster can be configured without code.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from persisting.config import PersistingSettings, QueueSettings
from persisting.errors import ConfigError


class BackendOptions(QueueSettings):
    """QueueSettings plus what only matters to one backend instance."""

    model_config = ConfigDict(extra="forbid")

    read_only: bool = False
    max_buffer_records: int = Field(default=1_000_000, gt=0)
    max_buffer_bytes: int = Field(default=256 << 20, gt=0)
    poll_interval_s: float = Field(default=0.05, gt=0)
    lock_timeout_s: float = Field(default=10.0, ge=0)
    compact_target_rows: int = Field(default=1 << 20, gt=1)
    read_batch_size: int = Field(default=1000, gt=0)
    retention_interval_s: float = Field(default=5.0, gt=0)


def resolve_options(batch_size: int, options: dict[str, Any]) -> BackendOptions:
    """Validated options: ``options`` over the settings' queue section, ``batch_size`` last.

    ``options`` may hold ``settings`` (a PersistingSettings or QueueSettings) to take the
    defaults from instead of the environment.
    """
    options = dict(options)
    settings = options.pop("settings", None)
    if settings is None:
        base = PersistingSettings.load().queue
    elif isinstance(settings, PersistingSettings):
        base = settings.queue
    elif isinstance(settings, QueueSettings):
        base = settings
    else:
        raise ConfigError(f"settings must be PersistingSettings or QueueSettings, got {settings!r}")
    merged = {**base.model_dump(), **options, "batch_size": batch_size}
    try:
        return BackendOptions(**merged)
    except ValidationError as exc:
        raise ConfigError(f"invalid LanceBackend options: {exc}") from exc


__all__ = ["BackendOptions", "resolve_options"]
