"""Child process of the cluster tests: one LMCache entry point on a ``cluster`` key.

    python cluster_child.py ENTRY MODE CLUSTER_JSON

``ENTRY`` is ``plugin`` (LMCache's StorageManager loading the storage plugin) or ``l2``
(LMCache's factory building the L2 adapter from its ``--l2-adapter`` JSON). ``set`` stores
``N`` chunks; ``get`` asks for them and loads them: it prints one JSON line with how many
were found and, per loaded chunk, whether its bytes are the ones stored.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

N = 4


def plugin(mode: str, cluster: dict[str, Any]) -> dict[str, Any]:
    from tests.lmcache.lmcache_harness import (
        cpu_of,
        filled,
        key,
        make_config,
        payload,
        plugin_of,
        same_bytes,
        storage_manager,
    )

    config = make_config(None)
    config.storage_plugins = ["PersistingBackend"]
    config.extra_config = {
        "storage_plugin.PersistingBackend.module_path": "persisting.lmcache_backend",
        "storage_plugin.PersistingBackend.class_name": "PersistingKVBackend",
        "persisting.cluster": cluster,
    }
    keys = [key(i) for i in range(N)]
    with storage_manager(config) as manager:
        backend = plugin_of(manager)
        if mode == "set":
            objs = [filled(cpu_of(manager), i) for i in range(N)]
            futures = backend.batched_submit_put_task(keys, objs) or []
            backend.wait_for_puts()
            for obj in objs:
                obj.ref_count_down()
            return {"failed": sum(f.exception() is not None for f in futures)}
        found = backend.batched_contains(keys)
        got = backend.batched_get_blocking(keys)
        exact = []
        for i, obj in enumerate(got):
            if obj is None:
                exact.append(None)
                continue
            tensor = obj.tensor
            assert tensor is not None
            exact.append(same_bytes(tensor, payload(i, tensor.shape, tensor.dtype)))
            obj.ref_count_down()
        return {"found": found, "exact": exact}


def l2(mode: str, cluster: dict[str, Any]) -> dict[str, Any]:
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    from tests.lmcache.l2_harness import (
        bytes_of,
        l2_config,
        load,
        lookup,
        object_key,
        payload,
        store,
        tensor_obj,
    )

    entry = {
        "type": "plugin",
        "module_path": "persisting.lmcache",
        "class_name": "PersistingL2Adapter",
        "adapter_params": {"cluster": cluster, "namespace": "lmcache-l2-cluster"},
    }
    (config,) = l2_config(entry).adapters
    adapter = create_l2_adapter_from_registry(config)
    keys = [object_key(i) for i in range(N)]
    try:
        if mode == "set":
            result = store(adapter, keys, [tensor_obj(i) for i in range(N)])
            return {"ok": bool(result.is_successful())}
        found = lookup(adapter, keys)
        objs = [tensor_obj(None) for _ in range(N)]
        loaded = load(adapter, keys, objs)
        exact = [
            bool(torch.equal(bytes_of(objs[i]), payload(i, 2 * 4 * 16 * 256 * 2)))
            if i in loaded
            else None
            for i in range(N)
        ]
        return {"found": len(found), "exact": exact}
    finally:
        adapter.close()


def main() -> None:
    entry, mode, cluster = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    result = plugin(mode, cluster) if entry == "plugin" else l2(mode, cluster)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
