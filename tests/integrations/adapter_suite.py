"""One behaviour suite for every engine adapter, on both kinds of store (local root, cluster).

Each adapter names its values the way its engine does (the SGLang backend's page keys, the
LMCache L2 adapter's object keys, the vLLM connector's block keys, each in the namespace its
own builder makes) and moves them between the store and the memory its engine owns (SGLang
host pages in two parts, LMCache memory objects, rows of vLLM's CPU tier), through the
engine adapters' one interface (:class:`~persisting.integrations.common.store.EngineStore`;
the SGLang backend's own :class:`~persisting.integrations.sglang.page_store.PageStore` on
it). The same checks run for each: set/get bit-exact, batched existence and the leading
run, a missing key a miss, bad input a typed error.

``python tests/integrations/adapter_suite.py '<json args>'`` runs the suite of one adapter
against a cluster in its own process (one Pulsing system per process, as an engine has) and
prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from persisting.errors import InvalidKeyError, InvalidValueError
from persisting.integrations.common.store import EngineStore
from persisting.integrations.sglang.namespace import PageKeys, PageShape, Shard
from persisting.integrations.sglang.namespace import namespace_name as sglang_namespace
from persisting.integrations.sglang.page_store import PageStore
from persisting.integrations.vllm.namespace import block_key
from persisting.integrations.vllm.namespace import namespace_name as vllm_namespace

MODEL = "org/Suite-Model-7B"
#: Bytes of one value (a page, a memory object, a CPU-tier row).
VALUE_BYTES = 3 * 4096 + 512


class Adapter:
    """An engine's keys and memory, moved through :class:`EngineStore` (overridden where
    the engine adapter has its own class on it)."""

    name = ""
    namespace = ""

    def keys(self, base: int, n: int) -> list[str]:
        raise NotImplementedError

    def buffers(self, n: int, seed: int | None) -> list[Any]:
        """``n`` values of engine memory, filled from ``seed`` (zeros if None)."""
        raise NotImplementedError

    def content(self, buffer: Any) -> bytes:
        parts = buffer if isinstance(buffer, list) else [buffer]
        return b"".join(bytes(memoryview(p).cast("B")) for p in parts)

    def bind(self, store: EngineStore) -> None:
        self.store = store

    def write(self, keys: list[str], buffers: list[Any]) -> list[bool]:
        return [r != "failed" for r in self.store.write_from(keys, buffers)]

    def read(self, keys: list[str], buffers: list[Any]) -> list[bool]:
        return [r == "hit" for r in self.store.read_into(keys, buffers)]

    def leading(self, keys: list[str]) -> int:
        return self.store.leading(keys)


def _random(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class SGLangPages(Adapter):
    """SGLang's HiCache backend: host pages of two parts (K and V), through its PageStore."""

    name = "sglang"

    def __init__(self) -> None:
        shape = PageShape("MHATokenToKVPoolHost", "page_first", 64, "bfloat16", (6144, 6656))
        shard = Shard(tp_rank=1, tp_size=2)
        self.namespace = sglang_namespace(MODEL, {"version": "suite"}, shape, shard)
        self._keys = PageKeys(self.namespace, shape, shard)
        self._split = shape.part_bytes[0]

    def keys(self, base: int, n: int) -> list[str]:
        return [self._keys.key(f"{base + i:064x}") for i in range(n)]

    def buffers(self, n: int, seed: int | None) -> list[Any]:
        pool = np.zeros((n, VALUE_BYTES), np.uint8)  # the host pool, one page a row
        for i in range(n):
            if seed is not None:
                pool[i] = _random(seed + i, VALUE_BYTES)
        return [[pool[i, : self._split].data, pool[i, self._split :].data] for i in range(n)]

    def bind(self, store: EngineStore) -> None:
        super().bind(store)
        self.pages = PageStore(store, VALUE_BYTES, refresh_interval_s=0.0)

    def write(self, keys: list[str], buffers: list[Any]) -> list[bool]:
        return self.pages.write(keys, buffers, None)

    def read(self, keys: list[str], buffers: list[Any]) -> list[bool]:
        return self.pages.read(keys, buffers)

    def leading(self, keys: list[str]) -> int:
        return self.pages.leading_run(keys)


class LMCacheObjects(Adapter):
    """LMCache's L2 adapter: LMCache's own memory objects under its object keys."""

    name = "lmcache"

    def __init__(self) -> None:
        self.namespace = "lmcache-suite"
        self._kept: list[Any] = []

    def keys(self, base: int, n: int) -> list[str]:
        from lmcache.v1.distributed.api import ObjectKey

        from persisting.integrations.lmcache.object_keys import object_key_text

        return [
            object_key_text(
                self.namespace,
                ObjectKey(
                    chunk_hash=(base + i).to_bytes(8, "big"),
                    model_name=MODEL,
                    kv_rank=0,
                    object_group_id=0,
                    cache_salt="",
                ),
            )
            for i in range(n)
        ]

    def buffers(self, n: int, seed: int | None) -> list[Any]:
        import torch
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        objs = []
        for i in range(n):
            raw = torch.zeros(VALUE_BYTES, dtype=torch.uint8)
            if seed is not None:
                raw = torch.from_numpy(_random(seed + i, VALUE_BYTES))
            meta = MemoryObjMetadata(
                shape=torch.Size([VALUE_BYTES]),
                dtype=torch.uint8,
                address=0,
                phy_size=VALUE_BYTES,
                fmt=MemoryFormat.KV_2LTD,
                ref_count=1,
            )
            objs.append(TensorMemoryObj(raw, meta, parent_allocator=None))
        self._kept += objs  # the buffers below are views of these objects' memory
        return [obj.byte_array for obj in objs]


class VLLMRows(Adapter):
    """vLLM's CPU tier: one row of its tensor per block, under the connector's block keys."""

    name = "vllm"

    def __init__(self) -> None:
        self.namespace = vllm_namespace(MODEL, {"dtype": "bfloat16", "suite": True})

    def keys(self, base: int, n: int) -> list[str]:
        return [
            block_key(self.namespace, (base + i).to_bytes(32, "big"), 0, "bfloat16")
            for i in range(n)
        ]

    def buffers(self, n: int, seed: int | None) -> list[Any]:
        rows = np.zeros((n, VALUE_BYTES), np.uint8)
        for i in range(n):
            if seed is not None:
                rows[i] = _random(seed + i, VALUE_BYTES)
        return [rows[i] for i in range(n)]


ADAPTERS: dict[str, Callable[[], Adapter]] = {
    "sglang": SGLangPages,
    "lmcache": LMCacheObjects,
    "vllm": VLLMRows,
}


# -- the checks ---------------------------------------------------------------------------


def set_and_get_are_bit_exact(a: Adapter) -> None:
    keys, source = a.keys(100, 6), a.buffers(6, seed=1)
    assert a.write(keys, source) == [True] * 6
    assert a.write(keys[:2], source[:2]) == [True, True]  # present already: still stored
    target = a.buffers(6, seed=None)
    assert a.read(keys, target) == [True] * 6
    assert [a.content(t) for t in target] == [a.content(s) for s in source]


def existence_and_the_leading_run_are_batched(a: Adapter) -> None:
    keys = a.keys(200, 4)
    assert a.write([keys[0], keys[1], keys[3]], [*a.buffers(2, 7), *a.buffers(1, 9)]) == [True] * 3
    assert a.store.exists(keys) == [True, True, False, True]
    assert a.leading(keys) == 2
    assert a.leading(keys[2:]) == 0
    assert a.store.exists([]) == [] and a.leading([]) == 0


def a_missing_key_is_a_miss(a: Adapter) -> None:
    keys = a.keys(300, 3)
    assert a.write(keys[:1], a.buffers(1, 3)) == [True]
    target = a.buffers(3, seed=None)
    assert a.read(keys, target) == [True, False, False]
    assert a.content(target[1]) == bytes(VALUE_BYTES)  # a miss leaves the memory as it was


def a_removed_key_is_a_miss(a: Adapter) -> None:
    keys = a.keys(400, 2)
    assert a.write(keys, a.buffers(2, 4)) == [True, True]
    assert a.store.remove(keys[:1]) == 1
    assert a.store.exists(keys) == [False, True]
    assert a.read(keys, a.buffers(2, None)) == [False, True]


def bad_input_is_a_typed_error(a: Adapter) -> None:
    keys = a.keys(500, 2)
    other = keys[0].replace(a.namespace, "another-namespace", 1)
    for bad in ("not a key", other):
        for call in (
            lambda k: a.store.write_from(k, a.buffers(1, 1)),
            lambda k: a.store.read_into(k, a.buffers(1, None)),
            lambda k: a.store.exists(k),
        ):
            try:
                call([bad])
            except InvalidKeyError:
                continue
            raise AssertionError(f"{bad!r} was taken")
    for call in (
        lambda: a.store.write_from(keys, a.buffers(1, 1)),  # one buffer for two keys
        lambda: a.store.read_into(keys[:1], [bytes(VALUE_BYTES)]),  # read-only memory
        lambda: a.store.read_into(keys[:1], [object()]),  # not memory at all
    ):
        try:
            call()
        except InvalidValueError:
            continue
        raise AssertionError("bad buffers were taken")


CHECKS = [
    set_and_get_are_bit_exact,
    existence_and_the_leading_run_are_batched,
    a_missing_key_is_a_miss,
    a_removed_key_is_a_miss,
    bad_input_is_a_typed_error,
]


def run_suite(adapter: Adapter, store: EngineStore) -> dict[str, str]:
    """Every check on ``adapter`` over ``store``: ``"ok"`` or the failure, per check."""
    adapter.bind(store)
    results = {}
    for check in CHECKS:
        try:
            check(adapter)
            results[check.__name__] = "ok"
        except Exception as exc:  # reported by name, so one run shows every failure
            results[check.__name__] = f"{type(exc).__name__}: {exc}"
    return results


def main() -> None:
    """One adapter's suite against the cluster ``args["cluster"]`` names."""
    from persisting.integrations.common import EngineSettings, open_engine_store

    args = json.loads(sys.argv[1])
    code = 1
    try:
        adapter = ADAPTERS[args["adapter"]]()
        settings = EngineSettings.model_validate({"cluster": args["cluster"]})
        store = open_engine_store(settings, adapter.namespace)
        try:
            result = {"kind": store.kind, **run_suite(adapter, store)}
        finally:
            store.close()
        print("RESULT " + json.dumps(result), flush=True)
        code = 0
    except BaseException as exc:
        print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
    sys.stdout.flush()
    os._exit(code)  # Pulsing may crash at interpreter exit after a shutdown


if __name__ == "__main__":
    main()
