"""Test harness for the L2 adapter: real LMCache 0.5.6 multiprocess-mode machinery.

Adapters are built the way LMCache builds them from its ``--l2-adapter`` JSON (config
parsing, the plugin factory, Persisting's config class found by name); storage managers
are LMCache's own ``lmcache.v1.distributed.storage_manager.StorageManager`` with a real L1
(CPU memory) and its store, prefetch and eviction controllers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdaptersConfig,
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd, current_device_spec

from persisting.integrations.lmcache import PersistingL2Adapter
from tests.timing import wait_until

MODEL = "meta-llama/Llama-3-8B"
#: One chunk of a small model as LMCache's L1 lays it out: 64 KiB of bfloat16.
LAYOUT = MemoryLayoutDesc(shapes=[torch.Size([2, 4, 16, 256])], dtypes=[torch.bfloat16])


def adapter_json(
    root: Path, *, entry: dict[str, Any] | None = None, **params: Any
) -> dict[str, Any]:
    """The ``--l2-adapter`` entry a user writes (docs/lmcache.md); ``entry`` adds LMCache's
    own keys beside ``adapter_params`` (such as ``eviction``)."""
    return {
        "type": "plugin",
        "module_path": "persisting.lmcache",
        "class_name": "PersistingL2Adapter",
        "adapter_params": {"storage_path": str(root), **params},
        **(entry or {}),
    }


def l2_config(*entries: dict[str, Any]) -> L2AdaptersConfig:
    """LMCache's own parsing of ``--l2-adapter`` arguments."""
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args([a for e in entries for a in ("--l2-adapter", json.dumps(e))])
    return parse_args_to_l2_adapters_config(args)


@contextlib.contextmanager
def l2_adapter(root: Path, **params: Any) -> Iterator[PersistingL2Adapter]:
    """An adapter made by LMCache's factory from its JSON config; closed afterwards."""
    (config,) = l2_config(adapter_json(root, **params)).adapters
    adapter = create_l2_adapter_from_registry(config)
    assert isinstance(adapter, PersistingL2Adapter)
    try:
        yield adapter
    finally:
        adapter.close()


@contextlib.contextmanager
def storage_manager(*entries: dict[str, Any], l1_bytes: int = 32 << 20) -> Iterator[StorageManager]:
    """LMCache's multiprocess-mode StorageManager with the given L2 adapters; closed after."""
    memory = L1MemoryManagerConfig(
        size_in_bytes=l1_bytes,
        use_lazy=current_device_spec.is_pin_supported,
        init_size_in_bytes=l1_bytes,
        align_bytes=0x1000,
    )
    config = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(
            memory_config=memory, write_ttl_seconds=600, read_ttl_seconds=300
        ),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=l2_config(*entries),
    )
    manager = StorageManager(config)
    try:
        yield manager
    finally:
        manager.close()


def adapter_of(manager: StorageManager) -> PersistingL2Adapter:
    ((_descriptor, adapter),) = manager.l2_adapters()
    assert isinstance(adapter, PersistingL2Adapter)
    return adapter


def object_key(
    i: int, *, model: str = MODEL, rank: int = 0, group: int = 0, salt: str = "", width: int = 8
) -> ObjectKey:
    return ObjectKey(
        chunk_hash=(i * 0x9E3779B97F4A7C15 % (1 << 64))
        .to_bytes(8, "big")[-width:]
        .rjust(width, b"\0"),
        model_name=model,
        kv_rank=rank,
        object_group_id=group,
        cache_salt=salt,
    )


def payload(seed: int, nbytes: int) -> torch.Tensor:
    """Deterministic random bytes (any mix-up shows)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def tensor_obj(
    seed: int | None, shape: tuple[int, ...] = (2, 4, 16, 256), dtype: torch.dtype = torch.bfloat16
) -> TensorMemoryObj:
    """A standalone TensorMemoryObj (as LMCache's own adapter tests make them), filled from
    ``seed`` (zeros if None)."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = payload(seed, nbytes) if seed is not None else torch.zeros(nbytes, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=torch.Size(shape),
        dtype=dtype,
        address=0,
        phy_size=nbytes,
        fmt=MemoryFormat.KV_2LTD,
        ref_count=1,
    )
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def bytes_of(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(obj.byte_array), dtype=torch.uint8)


def wait_fd(fd: int, timeout_s: float = 30.0) -> None:
    """Wait until LMCache's event fd is signalled, and consume it (as its controllers do)."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if not poll.poll(timeout_s * 1000):
        raise TimeoutError(f"event fd {fd} not signalled in {timeout_s}s")
    with contextlib.suppress(BlockingIOError):
        consume_fd(fd)


def store(adapter: PersistingL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> Any:
    """A store task, waited for through its event fd; returns its L2StoreResult."""
    task = adapter.submit_store_task(keys, objs)
    done: dict = {}

    def completed() -> bool:
        done.update(adapter.pop_completed_store_tasks())
        if task not in done:
            with contextlib.suppress(TimeoutError):
                wait_fd(adapter.get_store_event_fd(), 1)
        return task in done

    wait_until(completed, "the store task")
    return done[task]


def lookup(adapter: PersistingL2Adapter, keys: list[ObjectKey]) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {0: LAYOUT})
    return _wait_result(
        adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, task
    )


def load(adapter: PersistingL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> list[int]:
    task = adapter.submit_load_task(keys, objs)
    return _wait_result(adapter.get_load_event_fd(), adapter.query_load_result, task)


def _wait_result(fd: int, query: Any, task: int) -> list[int]:
    results: list[Any] = []

    def answered() -> bool:
        results.append(query(task))
        if results[-1] is None:
            with contextlib.suppress(TimeoutError):
                wait_fd(fd, 1)
        return results[-1] is not None

    wait_until(answered, "the task's result")
    return list(results[-1].get_indices_list())


class Recorder(L2AdapterListener):
    """Records listener notifications, as LMCache's own adapter tests do."""

    def __init__(self) -> None:
        self.stored: list[tuple[ObjectKey, int]] = []
        self.accessed: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self.stored.extend(zip(keys, sizes, strict=True))

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        self.accessed.extend(keys)

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        self.deleted.extend(keys)


def write_through_l1(manager: StorageManager, keys: list[ObjectKey], seed: int = 0) -> None:
    """Write chunks into LMCache's L1 (as an engine's store does) and wait until its store
    controller has put them into the adapter and released them."""
    reserved = manager.reserve_write(keys, LAYOUT)
    assert len(reserved) == len(keys)
    for i, key in enumerate(keys):
        obj = reserved[key]
        obj.byte_array.cast("B")[:] = payload(seed + i, obj.get_size()).numpy().tobytes()
    manager.finish_write(keys)
    adapter = adapter_of(manager)
    wait_until(
        lambda: all(
            adapter.debug_has_key(key) and manager._l1_manager.is_key_evictable(key) for key in keys
        ),
        "L2 stores",
    )


def prefetch(manager: StorageManager, keys: list[ObjectKey]) -> Any:
    """LMCache's prefetch of ``keys`` (L1, then L2); returns its PrefetchResult."""
    spec = PrefetchTaskSpec(
        key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)]
    )
    handle = manager.submit_prefetch_task(spec)
    assert manager.wait_prefetch_status(handle, 30)
    result = manager.query_prefetch_status(handle)
    assert result is not None
    return result


def eviction_order(manager: StorageManager) -> list[str]:
    """LMCache's L2 LRU policy's order for the adapter, least recently used first."""
    (state,) = manager._l2_eviction_controller._adapter_states
    return [repr(k) for k in state.eviction_policy.get_eviction_candidates(1 << 30)]


def du_bytes(directory: Path) -> int:
    """What ``du`` says a namespace directory occupies: payload files, metadata, directories
    and small files. The store counts all of it against ``capacity``."""
    done = subprocess.run(
        ["du", "-s", "--block-size=1", str(directory)], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[0])


def files_bytes(directory: Path) -> int:
    """Bytes of every payload file under a namespace directory (what ``du`` would count
    of them, block-rounded)."""
    total = 0
    for path in (directory / "payload").rglob("*.kv"):
        total += -(-path.stat().st_size // 4096) * 4096
    return total
