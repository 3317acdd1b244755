"""Test harness: real LMCache 0.5.6 objects around the Persisting plugin.

Builds LMCache configs with the plugin enabled by configuration only, StorageManagers (always
closed: they run a non-daemon loop thread), an ``LMCacheEngine`` with a CPU stand-in for
the GPU connector, deterministic keys and chunk contents.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager

from persisting.lmcache_backend import PersistingKVBackend

MODEL = "meta-llama/Llama-3-8B"
PLUGIN = "PersistingBackend"
#: Small but real-shaped: (layers, K/V, chunk tokens, kv heads, head size).
KV_SHAPE = (4, 2, 16, 2, 32)
CHUNK = KV_SHAPE[2]


def plugin_extra_config(root: Path, **persisting: Any) -> dict[str, Any]:
    """The ``extra_config`` a user writes to enable the plugin (issue 5's YAML)."""
    extra: dict[str, Any] = {
        f"storage_plugin.{PLUGIN}.module_path": "persisting.lmcache_backend",
        f"storage_plugin.{PLUGIN}.class_name": "PersistingKVBackend",
        "persisting.storage_path": str(root),
    }
    extra.update({f"persisting.{k}": v for k, v in persisting.items()})
    return extra


def make_config(
    root: Path | None,
    *,
    cpu_gb: float = 0.05,
    local_disk: Path | None = None,
    chunk_size: int = CHUNK,
    **persisting: Any,
) -> LMCacheEngineConfig:
    """LMCache config: a CPU tier, the plugin (if ``root``), LocalDiskBackend (if given)."""
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size,
        local_cpu=True,
        max_local_cpu_size=cpu_gb,
        lmcache_instance_id=f"persisting-test-{uuid.uuid4().hex[:8]}",
    )
    if root is not None:
        config.storage_plugins = [PLUGIN]
        config.extra_config = plugin_extra_config(root, **persisting)
    if local_disk is not None:
        config.local_disk = str(local_disk) + "/"
        config.max_local_disk_size = 1.0
    return config


def make_metadata(
    *,
    model: str = MODEL,
    worker_id: int = 0,
    world_size: int = 1,
    kv_shape: tuple[int, int, int, int, int] = KV_SHAPE,
    dtype: torch.dtype = torch.bfloat16,
) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=dtype,
        kv_shape=kv_shape,
        chunk_size=kv_shape[2],
    )


@contextlib.contextmanager
def storage_manager(
    config: LMCacheEngineConfig, metadata: LMCacheMetadata | None = None
) -> Iterator[StorageManager]:
    """A real StorageManager, closed (loop thread joined) whatever happens."""
    manager = StorageManager(config, metadata or make_metadata(), EventManager())
    try:
        yield manager
    finally:
        manager.close()


def plugin_of(manager: StorageManager) -> PersistingKVBackend:
    """The plugin instance LMCache loaded (LMCache only logs a plugin that fails to load)."""
    backend = manager.storage_backends.get(PLUGIN)
    assert backend is not None, f"plugin not loaded; backends: {list(manager.storage_backends)}"
    assert type(backend).__name__ == "PersistingKVBackend"
    return backend  # type: ignore[return-value]


def cpu_of(manager: StorageManager) -> LocalCPUBackend:
    backend = manager.storage_backends["LocalCPUBackend"]
    assert isinstance(backend, LocalCPUBackend)
    return backend


def key(
    i: int,
    *,
    model: str = MODEL,
    worker_id: int = 0,
    world_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    tags: dict[str, str] | None = None,
) -> CacheEngineKey:
    """A chunk key built directly (tests choose their hashes; see test_lmcache_token_hashes)."""
    configs = {f"lmcache.tag.{k}": v for k, v in (tags or {}).items()}
    # Negative and positive hashes, like LMCache's signed 64-bit chunk hashes.
    chunk_hash = (i * 0x9E3779B97F4A7C15) % (1 << 64) - (1 << 63)
    return CacheEngineKey(model, world_size, worker_id, chunk_hash, dtype, configs or None)


def payload(seed: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic chunk contents (random bits, so any byte mix-up shows)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (random bits include NaNs, which ``torch.equal`` calls unequal)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def filled(
    manager_or_cpu: StorageManager | LocalCPUBackend,
    seed: int,
    metadata: LMCacheMetadata | None = None,
    tokens: int | None = None,
) -> MemoryObj:
    """A chunk MemoryObj allocated the way LMCacheEngine.store allocates one, filled."""
    md = metadata or make_metadata()
    shapes = md.get_shapes(tokens or md.chunk_size)
    obj = manager_or_cpu.allocate(shapes, md.get_dtypes(), busy_loop=False)
    assert obj is not None and obj.tensor is not None
    obj.tensor.copy_(payload(seed, obj.tensor.shape, obj.tensor.dtype))
    return obj


class CPUConnector(GPUConnectorInterface):
    """A CPU stand-in for the GPU connector: a paged KV buffer ``[layers, 2, slots, hidden]``.

    ``from_gpu``/``to_gpu`` copy the tokens at ``slot_mapping[start:end]`` out of / into the
    buffer, in LMCache's KV_2LTD chunk layout ``[2, layers, tokens, hidden]``.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        assert memory_obj.tensor is not None
        memory_obj.tensor.copy_(self.kv[:, :, slots, :].permute(1, 0, 2, 3))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        assert memory_obj.tensor is not None
        self.kv[:, :, slots, :] = memory_obj.tensor.permute(1, 0, 2, 3)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.kv.shape[0], num_tokens, self.kv.shape[3]])


@contextlib.contextmanager
def cache_engine(
    config: LMCacheEngineConfig, metadata: LMCacheMetadata, connector: CPUConnector
) -> Iterator[LMCacheEngine]:
    """A real LMCacheEngine (StorageManager created by post_init), destroyed afterwards."""
    instance = config.lmcache_instance_id
    engine = LMCacheEngineBuilder.get_or_create(
        instance, config, metadata, connector, lambda *a: None, lambda *a: None
    )
    try:
        engine.post_init()
        yield engine
    finally:
        LMCacheEngineBuilder.destroy(instance)
