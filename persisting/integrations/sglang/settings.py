"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

That one JSON object carries SGLang's own keys (which backend class to load, whether it
speaks the zero-copy interface, prefetch knobs) and Persisting's side by side: SGLang's are
passed through untouched, ours are the engine adapters' shared keys
(:class:`~persisting.integrations.common.settings.EngineSettings`: ``storage_path`` or
``cluster``, sizes with units) with SGLang's defaults, and anything else is refused with
the closest known key, so a typo is an error at start rather than a default silently
used. Nothing here imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import field_validator

from persisting.integrations.common.settings import EngineSettings, read_settings

#: Keys SGLang 0.5.23 itself reads from the same object (the dynamic backend's class, the
#: zero-copy switch, and the prefetch knobs HiCache pops before the backend sees them).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)


class StorageSettings(EngineSettings):
    """What the extra config says about the Persisting L3 tier (the shared keys; SGLang's
    host pool is the memory tier, so there is no key of SGLang's own)."""

    #: Threads reading and writing the pages of one batch in parallel.
    io_threads: int = 8
    #: Whether pages are fsynced before a set returns (False: written whole and renamed into
    #: place, so they survive the process, not a power loss; a page lost so is a miss).
    fsync: bool = False

    @field_validator("disk_bytes")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be a positive size")
        return value


FIELDS = tuple(StorageSettings.model_fields)


def storage_settings(extra_config: Mapping[str, Any] | None) -> StorageSettings:
    """Persisting's settings from SGLang's extra config (SGLang's keys ignored)."""
    return read_settings(
        StorageSettings,
        extra_config,
        where="PersistingHiCacheStorage",
        passed=SGLANG_KEYS,
        noun="extra-config key",
    )


__all__ = ["FIELDS", "SGLANG_KEYS", "StorageSettings", "storage_settings"]
