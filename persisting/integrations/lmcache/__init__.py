"""Persisting inside LMCache (0.5.6): both of LMCache's storage extension points.

* :class:`PersistingKVBackend` (:mod:`.backend`): the in-process storage plugin
  (``StoragePluginInterface``), loaded through ``storage_plugins`` and ``extra_config``;
  ``persisting.lmcache_backend`` still names it for existing configurations.
* :class:`PersistingL2Adapter` (:mod:`.l2_adapter`): an L2 adapter of LMCache's
  multiprocess mode (``L2AdapterInterface``), loaded through a plugin adapter entry with
  ``module_path: persisting.lmcache`` (the documented path, re-exporting this package) or
  ``persisting.integrations.lmcache`` (LMCache finds :class:`PersistingL2AdapterConfig`
  beside it by name).

Modules: :mod:`.settings` (configuration, no LMCache import), :mod:`.health` (I/O errors),
:mod:`.compat` (keys and layouts on both sides), :mod:`.puts`, :mod:`.pins` and
:mod:`.backend` (the in-process plugin), :mod:`.object_keys`, :mod:`.l2_tasks`,
:mod:`.l2_io` and :mod:`.l2_adapter` (the L2 adapter).
Attributes load their module on first use, so importing this package alone does not
import LMCache.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "L2Params": "persisting.integrations.lmcache.settings",
    "PersistingKVBackend": "persisting.integrations.lmcache.backend",
    "PersistingL2Adapter": "persisting.integrations.lmcache.l2_adapter",
    "PersistingL2AdapterConfig": "persisting.integrations.lmcache.l2_store",
    "l2_params": "persisting.integrations.lmcache.settings",
    "PluginOptions": "persisting.integrations.lmcache.settings",
    "settings_from_extra_config": "persisting.integrations.lmcache.settings",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
