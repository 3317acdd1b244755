"""LMCache 0.5.6 with Persisting as a storage plugin, enabled by configuration only.

The YAML below is what a vLLM/SGLang deployment adds to its LMCache config file (the file
named by ``LMCACHE_CONFIG_FILE``). No GPU here: a CPU stand-in plays the engine's paged KV
buffer, and the real ``LMCacheEngine`` stores chunks from it and retrieves them into it.

    .venv/bin/python examples/lmcache_plugin.py                      # a temporary root
    .venv/bin/python examples/lmcache_plugin.py --storage-path ./lmcache-demo

It stores a prompt's KV cache, clears LMCache's own CPU tier, retrieves the prompt from
the plugin alone, then builds a second engine on the same root that finds every chunk.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# LMCache's own warnings (no vLLM, no controller) are expected here; set before importing it.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

MODEL = "meta-llama/Llama-3-8B"
CHUNK_TOKENS = 16  # LMCache's chunk_size (256 in production; small here to stay quick)
LAYERS, KV_HEADS, HEAD_SIZE = 4, 2, 32  # a toy model
PLUGIN = "PersistingBackend"

LMCACHE_YAML = """\
chunk_size: {chunk}
local_cpu: true
max_local_cpu_size: 0.05          # GB of LMCache's own CPU tier
storage_plugins: ["PersistingBackend"]
extra_config:
  storage_plugin.PersistingBackend.module_path: persisting.lmcache_backend
  storage_plugin.PersistingBackend.class_name: PersistingKVBackend
  persisting.storage_path: {root}
  persisting.memory_bytes: 16777216  # the plugin's own memory tier (16 MiB here)
"""


class CPUConnector(GPUConnectorInterface):
    """Stands in for the GPU connector: a paged KV buffer ``[layers, 2, slots, hidden]``.

    LMCache copies the slots of a chunk out of it on store (``from_gpu``) and back into it
    on retrieve (``to_gpu``), in its KV_2LTD chunk layout ``[2, layers, tokens, hidden]``.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        memory_obj.tensor.copy_(self.kv[:, :, slots, :].permute(1, 0, 2, 3))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        self.kv[:, :, slots, :] = memory_obj.tensor.permute(1, 0, 2, 3)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.kv.shape[0], num_tokens, self.kv.shape[3]])


def metadata() -> LMCacheMetadata:
    """What vLLM tells LMCache about the model and this worker (rank 0 of 1)."""
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK_TOKENS, KV_HEADS, HEAD_SIZE),
        chunk_size=CHUNK_TOKENS,
    )


@contextlib.contextmanager
def lmcache_engine(config_file: Path, connector: CPUConnector) -> Iterator[LMCacheEngine]:
    """A real LMCacheEngine built from the config file, destroyed (and its plugin closed)
    afterwards. LMCache only logs a plugin that fails to load, so check that it is there."""
    config = LMCacheEngineConfig.from_file(str(config_file))
    instance = f"example-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(
        instance, config, metadata(), connector, lambda *a: None, lambda *a: None
    )
    try:
        engine.post_init()
        backends = list(engine.storage_manager.storage_backends)
        if PLUGIN not in backends:
            raise SystemExit(f"the plugin did not load; LMCache backends: {backends}")
        yield engine
    finally:
        LMCacheEngineBuilder.destroy(instance)  # closes the StorageManager and the plugin


def run(root: Path) -> None:
    config_file = root / "lmcache.yaml"
    config_file.write_text(LMCACHE_YAML.format(chunk=CHUNK_TOKENS, root=root))
    print(f"LMCache config ({config_file}):\n{config_file.read_text()}")

    tokens = torch.arange(1000, 1000 + 4 * CHUNK_TOKENS)  # a 4-chunk prompt
    slots = torch.randperm(len(tokens))  # its pages, scattered over the KV buffer
    generator = torch.Generator().manual_seed(0)
    original = torch.randn(LAYERS, 2, len(tokens), KV_HEADS * HEAD_SIZE, generator=generator)
    original = original.to(torch.bfloat16)
    connector = CPUConnector(original.clone())

    # Without vLLM, LMCache hashes token chunks with Python's built-in hash of int tuples,
    # which PYTHONHASHSEED does not salt: every process computes the same keys (and so does
    # Persisting's TokenHasher(..., scheme="lmcache"); see docs/lmcache.md).
    with lmcache_engine(config_file, connector) as engine:
        manager = engine.storage_manager
        print(f"LMCache backends: {list(manager.storage_backends)}")
        engine.store(tokens, slot_mapping=slots)
        keys = [key for _s, _e, key in engine.token_database.process_tokens(tokens)]
        plugin = manager.storage_backends[PLUGIN]

        # The plugin completes puts write-behind, as LMCache's own backends do: a chunk is
        # readable once it is in the plugin's memory tier, and exists_in_put_tasks stays
        # true until its fsynced disk write. Wait for both, so the second engine finds them.
        def written() -> bool:
            return plugin.batched_contains(keys) == len(keys) and not any(
                plugin.exists_in_put_tasks(k) for k in keys
            )

        deadline = time.monotonic() + 30
        while not written() and time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"stored {len(tokens)} tokens: {plugin.batched_contains(keys)} chunks in the plugin")

        manager.clear(locations=["LocalCPUBackend"])  # only the plugin can serve them now
        print(f"after clearing LMCache's CPU tier, lookup = {engine.lookup(tokens)} tokens")
        connector.kv.zero_()
        retrieved = engine.retrieve(tokens, slot_mapping=slots)
        print(
            f"retrieved {int(retrieved.sum())} tokens from the plugin, "
            f"bit-exact: {torch.equal(connector.kv, original)}"
        )
        stats = plugin.stats()["stores"][MODEL]
        print(f"plugin store: disk_items={stats['disk_items']} corruptions={stats['corruptions']}")

    # A new engine (after a restart, on another replica sharing the root) finds the chunks:
    # LMCache's own LocalDiskBackend would start empty.
    fresh = CPUConnector(torch.zeros_like(original))
    with lmcache_engine(config_file, fresh) as engine:
        hit = engine.lookup(tokens)
        engine.retrieve(tokens, slot_mapping=slots)
        print(
            f"new engine on the same root: lookup = {hit} tokens, "
            f"bit-exact: {torch.equal(fresh.kv, original)}"
        )


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
        print("lmcache_plugin: done")


if __name__ == "__main__":
    main()
