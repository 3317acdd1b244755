"""The documented import path of Persisting's LMCache adapters, kept for configurations.

The code lives in :mod:`persisting.integrations.lmcache` (beside the other engine
adapters); LMCache's configuration names ``module_path: persisting.lmcache`` for the L2
adapter, and :mod:`persisting.lmcache.compat` and :mod:`persisting.lmcache.object_keys`
are documented, so these names stay: each name is the same object as under the new path.
Attributes load their module on first use, so importing this package alone does not
import LMCache.
"""

from __future__ import annotations

from typing import Any

from persisting.integrations import lmcache as _moved


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)


__all__ = list(_moved.__all__)
