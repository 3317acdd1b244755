"""Moved to :mod:`persisting.integrations.lmcache.object_keys`; this documented path stays."""

from persisting.integrations.lmcache.object_keys import *  # noqa: F403
from persisting.integrations.lmcache.object_keys import __all__  # noqa: F401
