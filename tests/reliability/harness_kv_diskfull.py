"""A KV store on a small filesystem that fills up: puts fail with CapacityError, reads go
on bit-exact, nothing torn is left behind, and puts succeed again once space returns.

    python -m tests.reliability.harness_kv_diskfull [--json OUT]

Mounts its own tmpfs (needs root); it fails -- it does not skip -- when it cannot.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from persisting.errors import CapacityError
from persisting.kv import open_kv_store
from tests.reliability.rel_common import MODEL, emit, key_text, value


def run(fs_mib: int = 12) -> dict:
    result = {"harness": "kv_diskfull", "filesystem_mib": fs_mib}
    with tempfile.TemporaryDirectory() as tmp:
        mnt = Path(tmp) / "fs"
        mnt.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={fs_mib}m", "tmpfs", str(mnt)], check=True
        )
        try:
            stored: list[int] = []
            refused = 0
            with open_kv_store(mnt, MODEL, memory_bytes=0, disk_bytes=1 << 30) as store:
                i = 0
                while refused < 3 and i < 500:
                    try:
                        store.put(key_text(i), value(i), fmt="KV_2TD")
                        stored.append(i)
                    except CapacityError:
                        refused += 1
                    i += 1
                reads_ok = sum(np.array_equal(store.get(key_text(j)), value(j)) for j in stored)
                torn = len(list(store.directory.glob("payload/*/*.tmp")))
                subprocess.run(["mount", "-o", f"remount,size={4 * fs_mib}m", str(mnt)], check=True)
                recovered = 0
                for j in range(1000, 1005):
                    store.put(key_text(j), value(j), fmt="KV_2TD")
                    recovered += int(np.array_equal(store.get(key_text(j)), value(j)))
            with open_kv_store(mnt, MODEL, memory_bytes=0, disk_bytes=1 << 30) as again:
                after_reopen = sum(np.array_equal(again.get(key_text(j)), value(j)) for j in stored)
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    result.update(
        puts_stored=len(stored),
        puts_refused_with_capacity_error=refused,
        reads_ok_while_full=int(reads_ok),
        torn_files_visible=torn,
        puts_ok_after_space_returned=recovered,
        reads_ok_after_reopen=int(after_reopen),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run()
    emit(result, args.json)
    ok = (
        result["puts_refused_with_capacity_error"] > 0
        and result["torn_files_visible"] == 0
        and result["reads_ok_while_full"] == result["puts_stored"]
        and result["puts_ok_after_space_returned"] == 5
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
