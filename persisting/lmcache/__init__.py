"""Persisting inside LMCache (0.5.6): both of LMCache's storage extension points.

* :class:`PersistingKVBackend` (:mod:`.backend`): the in-process storage plugin
  (``StoragePluginInterface``), loaded through ``storage_plugins`` and ``extra_config``;
  ``persisting.lmcache_backend`` still names it for existing configurations.

Modules: :mod:`.settings` (configuration, no LMCache import), :mod:`.compat` (keys and
layouts on both sides), :mod:`.puts` and :mod:`.backend` (the in-process plugin).
Attributes load their module on first use, so importing this package alone does not
import LMCache.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PersistingKVBackend": "persisting.lmcache.backend",
    "PluginOptions": "persisting.lmcache.settings",
    "settings_from_extra_config": "persisting.lmcache.settings",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
