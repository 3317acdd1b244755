"""Mooncake Store's side of ``remote_bench.py``, run with the Python of a separate venv that
has ``mooncake-transfer-engine-non-cuda==0.3.13.post1`` (its ``.so`` files need Debian's
``libibverbs1``, even for TCP). It imports no Persisting code.

    <venv>/bin/python benchmarks/mooncake_side.py storage <host> <master> <segment-bytes>
    <venv>/bin/python benchmarks/mooncake_side.py client <host> <master> <chunk-bytes> <chunks>

``storage`` contributes ``segment-bytes`` of memory to the store and waits until its stdin
closes. ``client`` contributes nothing (every value lives in the storage process), prints
``READY``, then answers JSON commands on stdin, one per line, with one JSON line:
``{"op": "put" | "get" | "batch_get" | "remove", "round": r, "batch": b}`` -> ``{"seconds": s,
"wrong": w}``. Values are ``chunks`` buffers of random bytes made once and registered with
the transfer engine (as its docs ask for zero-copy transfers); ``get`` and ``batch_get``
read each key of round ``r`` into registered destination buffers and count values that
differ from what was put.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

LOCAL_BUFFER = 256 << 20


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start : start + nbytes]


def _store(host: str, master: str, segment: int) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    code = store.setup(host, "P2PHANDSHAKE", segment, LOCAL_BUFFER, "tcp", "", master)
    if code != 0:
        raise SystemExit(f"mooncake setup failed: {code}")
    return store


def storage(host: str, master: str, segment: int) -> None:
    store = _store(host, master, segment)
    print("READY", flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    store.close()


def client(host: str, master: str, nbytes: int, chunks: int) -> None:
    store = _store(host, master, 0)
    rng = np.random.default_rng(7)
    sources = [_aligned(nbytes) for _ in range(chunks)]
    for s in sources:
        s[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    outs = [_aligned(nbytes) for _ in range(chunks)]
    for buffer in sources + outs:
        store.register_buffer(buffer.ctypes.data, nbytes)
    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        keys = [f"r{command['round']}-{i}" for i in range(chunks)]
        op = command["op"]
        wrong = 0
        start = time.perf_counter()
        if op == "remove":
            for key in keys:
                store.remove(key)
        elif op == "put":
            for key, source in zip(keys, sources, strict=True):
                if store.put_from(key, source.ctypes.data, nbytes) != 0:
                    wrong += 1
        elif op == "get":
            for key, out in zip(keys, outs, strict=True):
                if store.get_into(key, out.ctypes.data, nbytes) != nbytes:
                    wrong += 1
        else:
            batch = int(command["batch"])
            for first in range(0, chunks, batch):
                got = store.batch_get_into(
                    keys[first : first + batch],
                    [o.ctypes.data for o in outs[first : first + batch]],
                    [nbytes] * len(keys[first : first + batch]),
                )
                wrong += sum(1 for n in got if n != nbytes)
        seconds = time.perf_counter() - start
        if op in ("get", "batch_get"):
            wrong += sum(not np.array_equal(o, s) for o, s in zip(outs, sources, strict=True))
            for out in outs:
                out[:] = 0
        print(json.dumps({"seconds": seconds, "wrong": wrong}), flush=True)
    store.close()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "storage":
        storage(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
