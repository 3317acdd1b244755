"""The processes of benchmarks/fleet_mooncake_bench.py, one role each (run as a script:
``python fleet_mooncake_jobs.py ROLE CONFIG_JSON``; a job prints ``RESULT <json>``).

* ``mooncake-storage``: a Mooncake Store client that contributes a global segment to the
  pool and stays up (a member host's share of the pool);
* ``mooncake-job`` and ``persisting-job``: one client job in a new process on a client
  host: ``put`` (timed puts from memory the process keeps), ``read`` (timed ``get_into``
  one key after another, then timed batched gets into memory the process keeps), or
  ``probe`` (how many of the keys read back right, untimed, after a member was lost).

Only the standard library and the side's own client are imported, so the Mooncake roles
run in Mooncake's own environment (``.venv-mooncake``, scripts/install_mooncake.sh).
Values are random bytes made from the key's seed, checked byte for byte after the timing.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
MASTER_PORT = 50051
PERSISTING_NAME = "kvstore"
#: Small keys each job puts and gets first, untimed, so that it has spoken to every member.
WARM_KEYS = 8


def value_bytes(seed: int, index: int, nbytes: int) -> bytes:
    return random.Random(seed * 1_000_003 + index).randbytes(nbytes)


def settle(seconds: float) -> None:
    """Let the disk settle before a timed phase: the virtual disk keeps writing long after
    an fsync returns."""
    os.sync()
    time.sleep(seconds)


def kept_memory(count: int, nbytes: int) -> tuple[bytearray, list[memoryview]]:
    """One block the process keeps, every page touched, cut into ``count`` values."""
    block = bytearray(count * nbytes)
    block[::4096] = bytes(len(range(0, len(block), 4096)))  # fault every page in now
    view = memoryview(block)
    return block, [view[i * nbytes : (i + 1) * nbytes] for i in range(count)]


def address(block: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(block)).from_buffer(block))


#: CPU seconds of this process (all its threads) in each timed phase, by row.
CPU: dict[str, float] = {}


def timed(fn: Callable[[], Any], row: str) -> float:
    """Seconds ``fn`` took; its CPU seconds go to :data:`CPU` under ``row``."""
    cpu = time.process_time()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    CPU[row] = time.process_time() - cpu
    return seconds


def wrong_values(config: dict[str, Any], views: list[memoryview]) -> int:
    return sum(
        bytes(v) != value_bytes(config["seed"], i, config["nbytes"]) for i, v in enumerate(views)
    )


def batches(count: int, size: int) -> list[range]:
    return [range(s, min(s + size, count)) for s in range(0, count, size)]


# -- Mooncake Store ---------------------------------------------------------------------------


def mooncake_store(config: dict[str, Any], segment_bytes: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        config["local_ip"],
        "P2PHANDSHAKE",
        segment_bytes,
        config.get("local_buffer_bytes", 64 * MiB),
        "tcp",
        "",
        f"{config['master_ip']}:{MASTER_PORT}",
    )
    if code != 0:
        raise SystemExit(f"MooncakeDistributedStore.setup failed: {code}")
    return store


def mooncake_storage(config: dict[str, Any]) -> None:
    """A member host's segment: set up, say READY, stay up until killed."""
    store = mooncake_store(config, config["segment_bytes"])
    print("READY", flush=True)
    while True:
        time.sleep(3600)
    del store


def mooncake_job(config: dict[str, Any]) -> dict[str, Any]:
    from mooncake.store import ReplicateConfig

    store = mooncake_store(config, 0)  # a client: it contributes no memory to the pool
    n, nbytes = config["count"], config["nbytes"]
    keys = [f"{config['prefix']}-{i}" for i in range(n)]
    sizes = [nbytes] * n
    seconds: dict[str, float] = {}
    warm = bytearray(4096)
    store.register_buffer(address(warm), len(warm))
    for w in range(WARM_KEYS):  # connections to every member open, not timed
        warm_key = f"{config['prefix']}-warm-{config['job']}-{os.getpid()}-{w}"
        store.put_from(warm_key, address(warm), len(warm), ReplicateConfig())
        store.get_into(warm_key, address(warm), len(warm))
    if config["job"] == "put":
        block, views = kept_memory(n, nbytes)
        for i, v in enumerate(views):
            v[:] = value_bytes(config["seed"], i, nbytes)
        base = address(block)
        store.register_buffer(base, len(block))
        replicas = ReplicateConfig()
        replicas.replica_num = config["replicas"]
        codes: list[int] = []

        def put() -> None:
            for part in batches(n, config["batch"]):
                ptrs = [base + i * nbytes for i in part]
                codes.extend(store.batch_put_from([keys[i] for i in part], ptrs,
                                                  [nbytes] * len(part), replicas))  # fmt: skip

        settle(config["settle_s"])
        seconds["put"] = timed(put, "put")
        failed = sum(c != 0 for c in codes)
        return {"seconds": seconds, "failed": failed}
    block, views = kept_memory(n, nbytes)
    base = address(block)
    store.register_buffer(base, len(block))
    got: list[int] = []

    def get() -> None:
        for i in range(n):
            got.append(store.get_into(keys[i], base + i * nbytes, nbytes))

    settle(config["settle_s"])
    seconds["get"] = timed(get, "get")
    hits = [i for i, code in enumerate(got) if code == nbytes]
    wrong = sum(views[i] != value_bytes(config["seed"], i, nbytes) for i in hits)
    if config["job"] == "probe":
        return {"hits": len(hits) - wrong, "wrong": wrong, "seconds": seconds}
    block2, views2 = kept_memory(n, nbytes)
    base2 = address(block2)
    store.register_buffer(base2, len(block2))
    got2: list[int] = []

    def batched() -> None:
        for part in batches(n, config["batch"]):
            ptrs = [base2 + i * nbytes for i in part]
            got2.extend(store.batch_get_into([keys[i] for i in part], ptrs, sizes[: len(part)]))

    settle(config["settle_s"])
    seconds["batched get"] = timed(batched, "batched get")
    missed = sum(c != nbytes for c in got) + sum(c != nbytes for c in got2)
    wrong += wrong_values(config, views2)
    return {"seconds": seconds, "failed": missed, "wrong": wrong}


# -- Persisting -------------------------------------------------------------------------------


def persisting_job(config: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from persisting.config import PersistingSettings
    from persisting.service import SyncKVCacheClient

    model = config["model"]
    settings = PersistingSettings(service={"request_timeout_s": 120.0})
    client = SyncKVCacheClient.connect(seeds=config["seeds"], name=PERSISTING_NAME, model=model,
                                       passphrase=config["passphrase"], settings=settings,
                                       min_members=config["min_members"])  # fmt: skip
    try:
        return _persisting_rows(client, config)
    finally:
        client.close(timeout_s=10)


def _persisting_rows(client: Any, config: dict[str, Any]) -> dict[str, Any]:
    from persisting.kv import ChunkKey

    n, nbytes, model, base = config["count"], config["nbytes"], config["model"], config["key_base"]
    keys = [ChunkKey(model, 1, 0, base + i, "uint8") for i in range(n)]
    for w in range(WARM_KEYS):  # connections to every member open, not timed
        warm = ChunkKey(model, 1, 0, 10_000_000 + os.getpid() * WARM_KEYS + w, "uint8")
        client.put(warm, bytes(4096), fmt="binary")
        client.get_into(warm, bytearray(4096))
    seconds: dict[str, float] = {}
    if config["job"] == "put":
        _block, views = kept_memory(n, nbytes)
        for i, v in enumerate(views):
            v[:] = value_bytes(config["seed"], i, nbytes)

        def put() -> None:
            for part in batches(n, config["batch"]):
                client.batched_put([keys[i] for i in part], [views[i] for i in part], fmt="binary")

        settle(config["settle_s"])
        seconds["put"] = timed(put, "put")
        return {"seconds": seconds, "failed": 0}
    _block, views = kept_memory(n, nbytes)
    got: list[Any] = []

    def get() -> None:
        for i in range(n):
            got.append(client.get_into(keys[i], views[i]))

    settle(config["settle_s"])
    seconds["get"] = timed(get, "get")
    hits = [i for i, layout in enumerate(got) if layout is not None]
    wrong = sum(views[i] != value_bytes(config["seed"], i, nbytes) for i in hits)
    if config["job"] == "probe":
        if config.get("wait_copies"):
            _wait_copies(client, keys, config["wait_copies"])
        return {"hits": len(hits) - wrong, "wrong": wrong, "seconds": seconds}
    _block2, views2 = kept_memory(n, nbytes)
    got2: list[Any] = []

    def batched() -> None:
        for part in batches(n, config["batch"]):
            got2.extend(client.batched_get_into([keys[i] for i in part], [views2[i] for i in part]))

    settle(config["settle_s"])
    seconds["batched get"] = timed(batched, "batched get")
    missed = sum(x is None for x in got) + sum(x is None for x in got2)
    wrong += wrong_values(config, views2)
    return {"seconds": seconds, "failed": missed, "wrong": wrong}


def _wait_copies(client: Any, keys: list[Any], copies: int, timeout_s: float = 120.0) -> None:
    """Until every key is on ``copies`` members (the second copies made on first read)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = [0] * len(keys)
        for addr in client.members:
            flags = client._run(client.client.contains_on(addr, keys))
            held = [h + int(f) for h, f in zip(held, flags, strict=True)]
        if min(held) >= copies:
            return
        time.sleep(0.5)
    raise SystemExit(f"keys not on {copies} members within {timeout_s}s")


def main() -> None:
    role, config = sys.argv[1], json.loads(sys.argv[2])
    if role == "mooncake-storage":
        mooncake_storage(config)
        return
    result = mooncake_job(config) if role == "mooncake-job" else persisting_job(config)
    print("RESULT " + json.dumps({**result, "cpu": CPU}), flush=True)
    os._exit(0)  # neither client's threads need a clean interpreter exit here


if __name__ == "__main__":
    main()
