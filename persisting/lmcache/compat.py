"""Moved to :mod:`persisting.integrations.lmcache.compat`; this documented path stays."""

from persisting.integrations.lmcache.compat import *  # noqa: F403
from persisting.integrations.lmcache.compat import __all__  # noqa: F401
