"""LMCache's multiprocess mode with Persisting as an L2 adapter, by configuration only.

The JSON below is the ``--l2-adapter`` entry an LMCache server takes. No GPU here: the
server's storage manager (LMCache's own, with its L1 memory, store and prefetch
controllers) runs on the CPU, and this script plays the engine side: it writes a prompt's
chunks into L1, which LMCache's store controller copies into Persisting; it clears L1 and
prefetches the chunks back from Persisting; then it restarts the storage manager and finds
them again, with the same usage.

    .venv/bin/python examples/lmcache_mp_adapter.py                      # a temporary root
    .venv/bin/python examples/lmcache_mp_adapter.py --storage-path ./lmcache-demo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# LMCache's own info logging is noise here; set before importing it.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

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
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.platform import current_device_spec

L2_ADAPTER = {
    "type": "plugin",
    "module_path": "persisting.lmcache",
    "class_name": "PersistingL2Adapter",
    "adapter_params": {"storage_path": "<root>", "capacity": "1GiB", "durability": "sync"},
}
MODEL = "meta-llama/Llama-3-8B"
#: One chunk as LMCache's L1 lays it out for a toy model: [2, layers, tokens, hidden] bf16.
LAYOUT = MemoryLayoutDesc(shapes=[torch.Size([2, 4, 16, 256])], dtypes=[torch.bfloat16])


@contextlib.contextmanager
def storage_manager(root: Path) -> Iterator[StorageManager]:
    """LMCache's storage manager as its server builds it from ``--l2-adapter`` JSON."""
    entry = json.loads(json.dumps(L2_ADAPTER).replace("<root>", str(root)))
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    l2 = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(entry)]))
    memory = L1MemoryManagerConfig(
        size_in_bytes=32 << 20,
        use_lazy=current_device_spec.is_pin_supported,
        init_size_in_bytes=32 << 20,
        align_bytes=0x1000,
    )
    config = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(
            memory_config=memory, write_ttl_seconds=600, read_ttl_seconds=300
        ),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=l2,
    )
    manager = StorageManager(config)
    try:
        yield manager
    finally:
        manager.close()


def the_adapter(manager: StorageManager):  # type: ignore[no-untyped-def]
    ((_descriptor, adapter),) = manager.l2_adapters()
    return adapter


def prefetch_and_check(manager: StorageManager, keys: list[ObjectKey], chunks: list) -> str:  # type: ignore[type-arg]
    """LMCache's prefetch (L1, then L2) of ``keys``; how many came from L2, and whether the
    bytes are the ones written."""
    spec = PrefetchTaskSpec(
        key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)]
    )
    handle = manager.submit_prefetch_task(spec)
    manager.wait_prefetch_status(handle, 30)
    result = manager.query_prefetch_status(handle)
    with manager.read_prefetched_results(keys) as objs:
        exact = objs is not None and all(
            torch.equal(o.tensor, c) for o, c in zip(objs, chunks, strict=True)
        )
    manager.finish_read_prefetched(keys)
    return f"prefetch found {result.l2_hit_count} chunks in L2, bit-exact: {exact}"


def drop_from_l1(manager: StorageManager, keys: list[ObjectKey]) -> None:
    """Empty L1 of ``keys``. LMCache keeps a chunk locked in L1 while its store controller
    copies it to L2, which may still be under way here: on a used root the chunks are in L2
    from an earlier run already, so nothing above waited for that copy. A locked chunk is
    skipped by LMCache's delete, so delete until none is left."""
    deadline = time.monotonic() + 30
    while True:
        _deleted, skipped = manager.delete_l1_keys(keys)
        if skipped == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{skipped} chunk(s) stayed locked in L1")
        time.sleep(0.01)


def chunk_bytes(usage: Any) -> int:
    """The chunks' bytes on disk (payload and headers), summed over cache salts; the
    adapter's ``total_bytes_used`` adds the metadata table and directories, which the
    capacity also bounds."""
    return sum(usage.bytes_by_cache_salt.values())


def run(root: Path) -> None:
    print(f"--l2-adapter '{json.dumps(L2_ADAPTER)}'  (storage_path: {root})")
    keys = [
        ObjectKey(chunk_hash=bytes([i]) * 32, model_name=MODEL, kv_rank=0, cache_salt="demo")
        for i in range(4)
    ]
    generator = torch.Generator().manual_seed(0)
    chunks = [torch.randn(*LAYOUT.shapes[0], generator=generator).to(torch.bfloat16) for _ in keys]

    with storage_manager(root) as manager:
        adapter = the_adapter(manager)
        print(f"L2 adapters: {[type(a).__name__ for _d, a in manager.l2_adapters()]}")
        reserved = manager.reserve_write(keys, LAYOUT)  # the engine writes into L1...
        for key, chunk in zip(keys, chunks, strict=True):
            reserved[key].tensor.copy_(chunk)
        manager.finish_write(keys)  # ...and LMCache's store controller copies them into L2
        deadline = time.monotonic() + 30
        while not all(adapter.debug_has_key(k) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        drop_from_l1(manager, keys)  # only Persisting can serve them now
        usage = adapter.get_usage()  # LMCache has seen the store complete: its usage is in
        held = sum(adapter.debug_has_key(k) for k in keys)
        print(f"stored {len(keys)} chunks: L2 holds {held}, usage {chunk_bytes(usage)} bytes")
        print(f"on disk with the metadata table: {usage.total_bytes_used} bytes")
        print(f"after clearing L1: {prefetch_and_check(manager, keys, chunks)}")
        status = adapter.report_status()
        print(f"status: healthy={status['is_healthy']} io_errors={status['io_errors']}")

    # A restarted server finds every chunk, and starts from the usage it had.
    with storage_manager(root) as manager:
        usage = the_adapter(manager).get_usage()
        found = prefetch_and_check(manager, keys, chunks)
        print(f"restarted: {found}, usage {chunk_bytes(usage)} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", type=Path, help="storage root (default: a temp dir)")
    args = parser.parse_args()
    temporary = tempfile.TemporaryDirectory(prefix="persisting-example-")
    with contextlib.nullcontext(args.storage_path) if args.storage_path else temporary as tmp:
        root = Path(tmp).absolute()
        root.mkdir(parents=True, exist_ok=True)
        print(f"storage root: {root}")
        run(root)
        print("lmcache_mp_adapter: done")


if __name__ == "__main__":
    main()
