"""The in-process LMCache plugin under the name existing LMCache configurations use.

``storage_plugin.<name>.module_path: persisting.lmcache_backend`` with ``class_name:
PersistingKVBackend`` keeps working; the code lives in :mod:`persisting.lmcache`.
"""

from persisting.lmcache.backend import PersistingKVBackend
from persisting.lmcache.settings import PluginOptions, settings_from_extra_config

__all__ = ["PersistingKVBackend", "PluginOptions", "settings_from_extra_config"]
