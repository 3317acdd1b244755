"""SGLang's own storage classes on CPU, driven by a JSON plan: the SGLang side of the SGLang
tests and of ``benchmarks/sglang_l3_bench.py``. Runs in the SGLang environment
(``.venv-sglang``)::

    .venv-sglang/bin/python benchmarks/sglang_kit.py run PLAN.json OUT.json

No SGLang engine runs on a CPU-only host; what runs here is SGLang's code that drives an L3
backend: its device KV pool on the CPU (``MHATokenToKVPool`` / ``MLATokenToKVPool``), the
host pool built from it (``get_mha_host_pool_cls(info)`` / ``MLATokenToKVPoolHost``, in
its page-first or layer-first layout), its ``HiCacheStorageConfig`` and its
``StorageBackendFactory``, which builds the backend from the extra config exactly as
``--hicache-storage-backend dynamic`` does; then the backend is registered with the pool
as SGLang's cache controller does (``register_mem_pool_host``,
``register_mem_host_pool_v2``, ``on_host_pools_registered``). ``sgl_kernel``, ``triton``
and ``torchvision`` are stubbed first, as SGLang's own CPU unit tests stub ``sgl_kernel``
(``sglang.test.test_utils.maybe_stub_sgl_kernel``).

A plan: ``{"pool": {...}, "backend": {...}, "steps": [...]}``. ``pool``: ``kind`` (mha,
mla), ``layout``, ``layers``, ``heads``, ``head_dim``, ``page_size``, ``pages``.
``backend``: ``name`` (``dynamic`` with ``extra``, Persisting's extra config; or ``file``
with ``dir``: SGLang's HiCacheFile), ``tp_rank``, ``tp_size``. Steps, each answered in the
output in order (a step that raises is answered ``{"error": ...}``):

- ``{"do": "fill", "slots": [..], "seed": s}``: random bytes into those host pages;
- ``{"do": "zero"}``: zeros over the whole host pool;
- ``{"do": "digest", "slots": [..]}``: the SHA-256 of each host page's bytes;
- ``{"do": "set", "keys": [..], "slots": [..]}``: ``batch_set_v1`` (the v1 pair), or for
  the file backend the controller's generic path (``get_data_page`` then ``batch_set``);
- ``{"do": "get", "keys": [..], "slots": [..]}``: ``batch_get_v1``, or the generic path
  (``get_dummy_flat_data_page``, ``batch_get``, ``set_from_flat_data_page``);
- ``{"do": "set_flat"|"get_flat", ...}``: the generic path on the Persisting backend;
- ``{"do": "exists", "keys": [..]}``: ``batch_exists``;
- ``{"do": "damage", "key": k}``: flip a byte in the middle of the page's payload file;
- ``{"do": "disk"}``: bytes under the storage root (``du``) and the backend's stats;
- ``{"do": "clear"}``: ``clear()``;
- ``{"do": "settle", "seconds": s}``: ``os.sync()`` and a pause (the disk keeps flushing
  after writes; benchmarks settle it before each timed phase);
- ``{"do": "uncache", "dir": D}``: drop the page cache (``/proc/sys/vm/drop_caches`` as
  root, else ``posix_fadvise(DONTNEED)`` over every file under D), for cold reads;
- ``{"do": "timed", "step": {...}}``: run one step; its result and the seconds it took;
- ``{"do": "kill"}``: SIGKILL this process (nothing closed, nothing flushed).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

STUBBED = ("sgl_kernel", "triton", "torchvision")


def stub_kernels() -> None:
    """Stub the GPU-only packages SGLang imports, as its CPU unit tests stub sgl_kernel.

    torch's own triton-aware modules are imported first, while ``triton`` is absent: torch
    then knows it has no triton, and only SGLang sees the stub (whose kernels, decorated
    at import, are never launched here)."""
    import torch._inductor.compile_fx
    import torch.utils.flop_counter  # noqa: F401

    class Loader(importlib.abc.Loader):
        def create_module(self, spec: Any) -> None:
            return None

        def exec_module(self, module: Any) -> None:
            from unittest.mock import MagicMock

            module.__getattr__ = lambda name: MagicMock()

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname.split(".")[0] in STUBBED:
                return importlib.machinery.ModuleSpec(fullname, Loader(), is_package=True)
            return None

    sys.meta_path.insert(0, Finder())


def host_pool(
    kind: str = "mha",
    layout: str = "page_first",
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    pages: int = 64,
    dtype: str = "bfloat16",
) -> Any:
    """An SGLang host pool on the CPU, built from a device pool as SGLang builds it."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    size = pages * page_size
    common = {"size": size, "page_size": page_size, "dtype": getattr(torch, dtype)}
    if kind == "mha":
        from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

        device = MHATokenToKVPool(
            **common,
            head_num=heads,
            head_dim=head_dim,
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
        )
        info = device.get_device_pool_infos()[0].buffer_info
        return get_mha_host_pool_cls(info)(
            info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=size,
            start_layer=0,
            end_layer=layers,
        )
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(
        **common,
        kv_lora_rank=head_dim,
        qk_rope_head_dim=16,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    info = device.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(
        info,
        1.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=size,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def storage_config(pool: Any, extra: dict[str, Any] | None, tp_rank: int, tp_size: int) -> Any:
    """SGLang's ``HiCacheStorageConfig`` as its cache controller fills it for ``pool``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=isinstance(pool, MLATokenToKVPoolHost),
        enable_storage_metrics=True,
        is_page_first_layout=pool.layout == "page_first",
        model_name="test-org/tiny-model",
        extra_config=extra,
    )


def backend(name: str, pool: Any, extra: dict[str, Any] | None, tp_rank: int, tp_size: int) -> Any:
    """The backend SGLang's factory builds, registered with ``pool`` as its cache
    controller registers it."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = storage_config(pool, dict(extra) if extra is not None else None, tp_rank, tp_size)
    built = StorageBackendFactory.create_backend(name, config, pool)
    built.register_mem_pool_host(pool)
    built.register_mem_host_pool_v2(pool, PoolName.KV)
    built.on_host_pools_registered()
    return built


def indices(pool: Any, slots: list[int]) -> Any:
    """Token indices of whole host pages ``slots`` (what SGLang hands a backend)."""
    import torch

    ps = pool.page_size
    return torch.cat([torch.arange(s * ps, (s + 1) * ps, dtype=torch.int64) for s in slots])


def page_bytes(pool: Any, slot: int) -> list[np.ndarray]:
    """The byte views of one host page's parts (through the pool's own metadata)."""
    from persisting.integrations.sglang.pages import HostPages

    return [
        np.frombuffer(v, np.uint8) for v in HostPages(pool).page_parts(indices(pool, [slot]))[0]
    ]


def page_keys(count: int, seed: int = 0) -> list[str]:
    """Chained SHA-256 hex digests, the shape of SGLang's page hashes."""
    keys, prior = [], hashlib.sha256(f"seed{seed}".encode()).digest()
    for i in range(count):
        prior = hashlib.sha256(prior + i.to_bytes(8, "little")).digest()
        keys.append(prior.hex())
    return keys


class Kit:
    """One pool and one backend, and the plan's steps over them."""

    def __init__(self, plan: dict[str, Any]):
        self.pool = host_pool(**plan.get("pool", {}))
        spec = plan["backend"]
        extra = spec.get("extra")
        if spec["name"] == "file":
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = spec["dir"]
            if spec.get("max_bytes"):
                os.environ["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] = str(spec["max_bytes"])
        self.generic = spec["name"] == "file"
        self.backend = backend(
            spec["name"], self.pool, extra, spec.get("tp_rank", 0), spec.get("tp_size", 1)
        )

    def step(self, step: dict[str, Any]) -> Any:
        do = step["do"]
        if do == "kill":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        if do == "timed":
            start = time.perf_counter()
            result = self.step(step["step"])
            return {"seconds": time.perf_counter() - start, "result": result}
        if do == "settle":
            os.sync()
            time.sleep(step.get("seconds", 3.0))
            return True
        if do == "uncache":
            return uncache(Path(step["dir"]))
        if do == "fill":
            for slot in step["slots"]:
                rng = np.random.default_rng([step.get("seed", 0), slot])
                for part in page_bytes(self.pool, slot):
                    part[:] = rng.integers(0, 256, part.size, dtype=np.uint8)
            return True
        if do == "zero":
            self.pool.kv_buffer.zero_()
            return True
        if do == "digest":
            return [
                hashlib.sha256(b"".join(p.tobytes() for p in page_bytes(self.pool, s))).hexdigest()
                for s in step["slots"]
            ]
        if do in ("set", "set_flat"):
            if self.generic or do == "set_flat":
                return self.generic_set(step["keys"], step["slots"])
            return self.backend.batch_set_v1(step["keys"], indices(self.pool, step["slots"]))
        if do in ("get", "get_flat"):
            if self.generic or do == "get_flat":
                return self.generic_get(step["keys"], step["slots"])
            return self.backend.batch_get_v1(step["keys"], indices(self.pool, step["slots"]))
        if do == "exists":
            return self.backend.batch_exists(step["keys"])
        if do == "damage":
            return self.damage(step["key"])
        if do == "disk":
            return self.disk(Path(step["root"]))
        if do == "clear":
            return bool(self.backend.clear())
        raise ValueError(f"unknown step {do!r}")

    def generic_set(self, keys: list[str], slots: list[int]) -> bool:
        """What SGLang's controller does for a backend without the v1 pair."""
        ps = self.pool.page_size
        data = [self.pool.get_data_page(s * ps) for s in slots]
        return bool(self.backend.batch_set(keys, data))

    def generic_get(self, keys: list[str], slots: list[int]) -> list[bool]:
        ps = self.pool.page_size
        dst = [self.pool.get_dummy_flat_data_page() for _ in keys]
        got = self.backend.batch_get(keys, dst)
        ok = []
        for slot, page in zip(slots, got or [None] * len(keys), strict=True):
            if page is not None:
                self.pool.set_from_flat_data_page(slot * ps, page)
            ok.append(page is not None)
        return ok

    def damage(self, key: str) -> str:
        """Flip one byte in the middle of the page's payload file."""
        store = self.backend.page_store.store.kv
        text = self.backend.keys.key(key)
        location = store.lease(text, 5.0)
        store.release(text, location.token)
        with open(location.path, "r+b") as f:
            at = location.offset + location.nbytes // 2
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        return location.path

    def disk(self, root: Path) -> dict[str, Any]:
        used = sum(
            os.lstat(os.path.join(d, n)).st_blocks * 512
            for d, dirs, files in os.walk(root)
            for n in [*dirs, *files]
        )
        stats = self.backend.get_stats()
        figures = getattr(stats, "persisting", None)
        return {"du_bytes": used, "stats": _jsonable(figures) if figures is not None else None}


def uncache(directory: Path) -> str:
    """Drop cached pages of the files under ``directory``; how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for d, _dirs, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run(plan_file: Path, out_file: Path) -> None:
    plan = json.loads(plan_file.read_text())
    stub_kernels()
    results: list[Any] = []
    try:
        kit = Kit(plan)
    except Exception as exc:
        out_file.write_text(json.dumps({"build_error": f"{type(exc).__name__}: {exc}"}))
        return
    for step in plan.get("steps", []):
        try:
            results.append(kit.step(step))
        except Exception as exc:
            results.append({"error": f"{type(exc).__name__}: {exc}"})
        out_file.write_text(json.dumps({"steps": results}))
    close = getattr(kit.backend, "close", None)
    if close is not None:
        close()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "run":
        sys.exit(__doc__)
    run(Path(sys.argv[2]), Path(sys.argv[3]))
