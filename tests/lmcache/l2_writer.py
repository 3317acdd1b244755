"""Child process of the L2 restart tests: store through LMCache, then exit, or die.

    python l2_writer.py ROOT MODE

``close``: LMCache's StorageManager stores ``KEYS`` through its L1 and the adapter, reads
``READ`` back (prefetch: they become the most recently used), prints a JSON line with the
adapter's usage and the order it would evict in, and shuts down cleanly.
``kill``: the adapter alone stores ``KEYS`` (sync, fsync) and the process SIGKILLs itself as
soon as the store task reports completion.
``torn``: the adapter stores ``KEYS`` (completed), then starts a store task of ``BIG`` large
chunks and SIGKILLs itself while that task is writing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.kv.kv_helpers import in_flight
from tests.lmcache.l2_harness import (
    adapter_json,
    adapter_of,
    l2_adapter,
    object_key,
    prefetch,
    storage_manager,
    store,
    tensor_obj,
    write_through_l1,
)
from tests.timing import wait_until

#: Keys of several salts, ranks and groups: all must come back as they were.
KEYS = [
    object_key(i, salt=("alice" if i % 3 == 0 else ""), rank=i % 2, group=i % 4 // 2)
    for i in range(10)
]
READ = [0, 1, 2]
BIG = 24
BIG_SHAPE = (2, 8, 256, 512)  # 4 MiB of bfloat16


def order_of(adapter) -> list[str]:  # type: ignore[no-untyped-def]
    keys, _sizes = adapter._resident()
    return [repr(k) for k in keys]


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "close":
        with storage_manager(adapter_json(root, capacity="64MiB")) as manager:
            write_through_l1(manager, KEYS[:5], seed=0)
            write_through_l1(manager, KEYS[5:], seed=5)
            manager.clear()
            result = prefetch(manager, [KEYS[i] for i in READ])
            assert result.l2_hit_count == len(READ), result
            manager.finish_read_prefetched([KEYS[i] for i in READ])
            adapter = adapter_of(manager)
            usage = adapter.get_usage()
            report = {
                "total": usage.total_bytes_used,
                "by_salt": dict(usage.bytes_by_cache_salt),
                "order": order_of(adapter),
            }
        print(json.dumps(report), flush=True)
        return
    with l2_adapter(root, capacity="256MiB") as adapter:
        done = store(adapter, KEYS, [tensor_obj(i) for i in range(len(KEYS))])
        assert done.is_successful()
        print("stored", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        big = [object_key(1000 + i) for i in range(BIG)]
        adapter.submit_store_task(big, [tensor_obj(1000 + i, BIG_SHAPE) for i in range(BIG)])
        wait_until(lambda: in_flight(root / "kv" / "lmcache"), "a store in flight")
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
