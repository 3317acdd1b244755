"""The engine-adapter layer every integration runs on (nothing here imports an engine).

* :mod:`.settings`: :class:`EngineSettings`, the keys every engine takes (where the store
  is: ``storage_path`` or ``cluster``; sizes with units; the namespace's parts), extended
  by each engine with its own keys; :func:`read_settings` reads them from the engine's
  configuration dict, refusing unknown keys by name.
* :mod:`.namespace`: one builder of namespaces (``<engine>.<label>.<digest>``) and keys.
* :mod:`.opener`: :func:`open_engine_store`, the store the settings name, local root or
  cluster, behind :class:`~.store.EngineStore`: batch-first ``read_into`` / ``write_from``
  between the store and memory the engine owns, and batched ``exists`` / ``leading``.
"""

from __future__ import annotations

from persisting.integrations.common.namespace import KeyBuilder, namespace_name
from persisting.integrations.common.opener import open_engine_store, open_local
from persisting.integrations.common.settings import (
    ClusterSettings,
    EngineSettings,
    read_settings,
)
from persisting.integrations.common.store import EngineStore, LocalStore

__all__ = [
    "ClusterSettings",
    "EngineSettings",
    "EngineStore",
    "KeyBuilder",
    "LocalStore",
    "namespace_name",
    "open_engine_store",
    "open_local",
    "read_settings",
]
