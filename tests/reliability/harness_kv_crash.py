"""SIGKILL a KV writer (durability="sync") at random points; verify after every restart.

    python -m tests.reliability.harness_kv_crash --kills 30 --seed 1 [--root DIR] [--json OUT]

Each round starts a writer process that puts values and prints each key's number once the
put has returned (acknowledged), kills it with SIGKILL after a random delay, then opens the
store in this process (a restart) and checks that every acknowledged value is present and
bit-exact, that values put but not acknowledged are absent or bit-exact (never torn), and
that no half-written file is visible.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from persisting.kv import open_kv_store
from tests.reliability.rel_common import MODEL, emit, key_text, run_and_kill, value

WRITER = """
import sys
from tests.reliability.rel_common import MODEL, key_text, value
from persisting.kv import open_kv_store
store = open_kv_store(sys.argv[1], MODEL, memory_bytes=0, disk_bytes=1 << 34, durability="sync")
i = int(sys.argv[2])
print("ready", flush=True)
while True:
    store.put(key_text(i), value(i, 128), fmt="KV_2TD")
    print(i, flush=True)
    i += 1
"""


def run(root: Path, kills: int, seed: int, time_budget_s: float = 240.0) -> dict:
    rng = random.Random(seed)
    acked: list[int] = []
    in_flight: list[int] = []
    next_i = 0
    started = time.monotonic()
    rounds = lost = wrong = torn = verified = 0
    for _ in range(kills):
        if time.monotonic() - started > time_budget_s:
            break
        writer = [sys.executable, "-c", WRITER, str(root), str(next_i)]
        new = run_and_kill(writer, rng.uniform(0.05, 0.6))
        acked.extend(new)
        last = new[-1] if new else next_i - 1
        rounds += 1
        in_flight.append(last + 1)
        next_i = last + 2  # never re-put the key that may have been mid-write
        with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 34) as store:
            for i in acked:
                verified += 1
                got = store.get(key_text(i))
                if got is None:
                    lost += 1
                elif not np.array_equal(got, value(i, 128)):
                    wrong += 1
            for i in in_flight:
                got = store.get(key_text(i))
                if got is not None and not np.array_equal(got, value(i, 128)):
                    torn += 1
            if list(store.directory.glob("payload/*/*.tmp")):
                torn += 1
    return {
        "harness": "kv_crash",
        "kills": rounds,
        "acknowledged_writes": len(acked),
        "verified_reads": verified,
        "lost_acknowledged": lost,
        "wrong_reads": wrong,
        "torn_visible": torn,
        "unacknowledged_in_flight": len(in_flight),
        "seconds": round(time.monotonic() - started, 1),
        "seed": seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.root or Path(tmp), args.kills, args.seed)
    emit(result, args.json)
    sys.exit(
        0
        if result["lost_acknowledged"] == result["wrong_reads"] == result["torn_visible"] == 0
        else 1
    )


if __name__ == "__main__":
    main()
