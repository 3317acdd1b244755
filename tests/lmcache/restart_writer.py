"""Child process of test_lmcache_restart: store chunks through LMCache, then exit or die.

    python restart_writer.py ROOT DISK_DIR COUNT DURABILITY {close,kill}

``close`` shuts LMCache down cleanly; ``kill`` SIGKILLs this process as soon as every put
has reported completion (nothing gets to flush or close).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from tests.lmcache.lmcache_harness import filled, key, make_config, plugin_of, storage_manager


def main() -> None:
    root, disk_dir, count, durability, ending = sys.argv[1:6]
    n = int(count)
    config = make_config(Path(root), local_disk=Path(disk_dir), durability=durability)
    with storage_manager(config) as manager:
        plugin = plugin_of(manager)
        done = threading.Semaphore(0)
        keys = [key(i) for i in range(n)]
        objs = [filled(manager, i) for i in range(n)]
        plugin.batched_submit_put_task(keys, objs, on_complete_callback=lambda _k: done.release())
        manager.batched_put(keys, objs)  # LocalDiskBackend (and the CPU tier) too
        for _ in range(n):
            if not done.acquire(timeout=60):
                raise SystemExit("puts did not complete")
        if ending == "kill":
            print("completed", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    print("closed", flush=True)


if __name__ == "__main__":
    main()
