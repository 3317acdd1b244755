"""The in-process LMCache plugin's configured name.

LMCache loads a storage plugin by module path and class name; Persisting's documented entry
is ``storage_plugin.<name>.module_path: persisting.lmcache_backend`` with ``class_name:
PersistingKVBackend`` (the name the LMCache plan gives users). This module is that entry; the
code lives in :mod:`persisting.integrations.lmcache`.
"""

from persisting.integrations.lmcache.backend import PersistingKVBackend
from persisting.integrations.lmcache.settings import PluginOptions, settings_from_extra_config

__all__ = ["PersistingKVBackend", "PluginOptions", "settings_from_extra_config"]
