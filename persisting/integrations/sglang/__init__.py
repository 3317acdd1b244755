"""SGLang integration: ``PersistingHiCacheStorage``, a HiCache L3 storage backend.

::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \
        --hicache-storage-backend dynamic \
        --hicache-storage-backend-extra-config '{"backend_name": "persisting",
            "module_path": "persisting.integrations.sglang",
            "class_name": "PersistingHiCacheStorage", "interface_v1": 1,
            "storage_path": "/var/lib/persisting", "disk_bytes": "500GiB"}'

Pages live under ``<storage_path>/kv/<namespace>/`` (see ``docs/sglang.md``). The backend
class imports SGLang, so it is loaded on first access (SGLang's factory looks it up by
name); the settings, namespace, page and page-store modules beside it do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from persisting.integrations.sglang.storage import PersistingHiCacheStorage


def __getattr__(name: str) -> Any:
    if name == "PersistingHiCacheStorage":
        from persisting.integrations.sglang.storage import PersistingHiCacheStorage

        return PersistingHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PersistingHiCacheStorage"]
