"""A KV store's options: what each means, which come from the settings, and which do not
go together. The settings themselves (with their environment variables) are
:class:`persisting.config.KVSettings`.

``KVStore`` and ``open_kv_store`` take the same keywords; those left out come from the
``kv`` settings (:data:`SETTINGS_OPTIONS`). Sizes take units as the settings do
(``"64 MB"``, ``"8GiB"``).

- ``storage_path``, ``model``: the storage root, and the model whose namespace this is
  (no ``'@'``: it separates key parts).
- ``memory_bytes``: the memory tier's budget (0: no memory tier).
- ``disk_bytes``: the disk tier's budget, for everything in the model's directory and
  all processes sharing it (0: no disk tier, nothing persists).
- ``durability``: when a put completes: ``"sync"`` (on disk), ``"async"`` (in memory,
  written behind) or ``"write_back"`` (written when evicted); see
  :mod:`persisting.kv.paths.puts`. The last two need a memory tier.
- ``eviction``: ``"value"`` (default: keeps what will be reused), ``"lru"``, ``"prefix"``
  (chain suffixes first) or an :class:`~persisting.kv.eviction.policy.EvictionPolicy`;
  both tiers.
- ``admission``: which puts go to disk: ``"always"``, ``"second_sighting"`` or an
  :class:`~persisting.kv.eviction.policy.AdmissionPolicy`.
- ``max_value_bytes``: the largest value a put takes (default: the larger tier).
- ``chunk_size``, ``hash_scheme``, ``key_dtype``: how token lookups hash token ids by
  default (tokens per chunk, ``"persisting"`` or LMCache's scheme, the key dtype in
  any spelling); see ``KVStore.token_hasher``.
- ``shared_memory``: keep the memory tier in a shared pool same-host processes read
  by place (``KVStore.shared_location``, ``KVStore.shared_pool``).
- ``result_buffer_bytes``: recycled pages for the values gets return (0: fresh memory).
- ``storage_access``: ``"owner"`` (files 0600, dirs 0700) or ``"group"`` (0640/0750).
- ``fsync``: whether write-through puts fsync before they complete (False leaves them
  in the page cache, as LMCache's own disk backends do); ``direct_io``: payloads skip
  the page cache where they can, for values another cache holds
  (:mod:`persisting.kv.disk.direct_io`).
- ``on_disk_evict``: told which chunks disk eviction removed, as ``(key, bytes)``, on
  the writing thread with the directory's usage lock held (quick, no calls back).
- ``read_threads``: disk reads a batch keeps in flight (at least 1).
- ``pinned_memory``: ``"auto"``, ``"on"`` or ``"off"``: the memory tier and staging
  ring in page-locked memory where CUDA is (see :mod:`persisting.cuda`).
- ``pinned_staging_bytes``: the pinned staging ring for device reads and writes.
- ``write_behind_lag_s``, ``write_behind_bytes``, ``clock``:
  :mod:`persisting.kv.disk.write_behind`.
- ``namespace``: the directory under ``<root>/kv/`` to keep the chunks in, when it is
  not the model's own (one per weights version of a model: see
  :func:`~persisting.kv.namespace.identity.weights_namespace`); keys still name ``model``.
- ``describe``: what this namespace holds, in words an operator reads in ``persisting
  inspect`` (engine, model, dtype, block size, layout, the weights' identity; JSON),
  recorded with the configured disk capacity (:mod:`~persisting.kv.namespace.record`).
"""

from __future__ import annotations

from persisting.errors import ConfigError, InvalidKeyError
from persisting.kv.keys import HASH_SCHEMES
from persisting.lance_store import validate_name

#: The options :meth:`KVStore.from_settings` takes from the ``kv`` settings.
SETTINGS_OPTIONS = (
    "memory_bytes",
    "disk_bytes",
    "durability",
    "eviction",
    "admission",
    "max_value_bytes",
    "chunk_size",
    "hash_scheme",
    "key_dtype",
    "result_buffer_bytes",
    "read_threads",
    "pinned_memory",
    "pinned_staging_bytes",
    "write_behind_lag_s",
    "write_behind_bytes",
)


def validate_model(model: object) -> str:
    """``model`` if it can name a namespace (a path-safe name without ``'@'``, which
    separates key parts), else InvalidNameError or InvalidKeyError."""
    name = validate_name(model, "model")
    if "@" in name:
        raise InvalidKeyError(f"model name {name!r} must not contain '@' (it separates key parts)")
    return name


def check_options(
    model: str,
    durability: str,
    memory_bytes: int,
    disk_bytes: int,
    read_threads: int,
    hash_scheme: str,
) -> None:
    """ConfigError (or InvalidKeyError for the model name) for options that do not go
    together, before anything is opened."""
    validate_model(model)
    if durability not in ("sync", "async", "write_back"):
        raise ConfigError(f"durability must be sync, async or write_back, not {durability!r}")
    if memory_bytes < 0 or disk_bytes < 0:
        raise ConfigError("tier capacities must not be negative")
    if read_threads < 1:
        raise ConfigError(f"read_threads must be at least 1, not {read_threads}")
    if durability != "sync" and memory_bytes == 0:
        raise ConfigError(f"durability={durability!r} needs a memory tier (memory_bytes > 0)")
    if hash_scheme not in HASH_SCHEMES:
        raise ConfigError(f"hash_scheme must be one of {HASH_SCHEMES}, not {hash_scheme!r}")


__all__ = ["SETTINGS_OPTIONS", "check_options"]
