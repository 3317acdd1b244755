"""SIGKILL the process hosting a WAL-backed queue bucket at random points; after every
restart, every acknowledged record must be there, exactly once, intact.

    python -m tests.reliability.harness_queue_crash --kills 30 --seed 1 [--json OUT]

The writer puts records (with a payload derived from their id, and a CRC-checked log under
them) and prints each id once ``put`` has returned. Some rounds flush part-way, so kills
land before, during and after flushes and log truncation.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

from persisting.queue import open_bucket
from tests.reliability.rel_common import emit, run_and_kill

TOPIC = "reliability/events"

WRITER = """
import asyncio, sys
from persisting.queue import open_bucket

async def main(root, start, flush_every):
    backend = open_bucket(root, TOPIC, 0, batch_size=1 << 30, flush_interval_s=0)
    print("ready", flush=True)
    i = start
    while True:
        await backend.put({"id": i, "payload": bytes([i % 251]) * (64 + i % 900),
                           "ok": i % 2 == 0, "name": f"r{i}"})
        print(i, flush=True)
        i += 1
        if flush_every and i % flush_every == 0:
            await backend.flush()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
""".replace("TOPIC", repr(TOPIC))


def expected(i: int) -> dict:
    return {
        "id": i,
        "payload": bytes([i % 251]) * (64 + i % 900),
        "ok": i % 2 == 0,
        "name": f"r{i}",
    }


async def _read_all(root: Path) -> list[dict]:
    """Restart the bucket's host (a writer replays the log) and read every record."""
    backend = open_bucket(root, TOPIC, 0)
    try:
        total = backend.total_count()
        out: list[dict] = []
        while len(out) < total:
            batch = await backend.get(limit=5000, offset=len(out))
            if not batch:
                break
            out.extend(batch)
        return out
    finally:
        backend.close()


def run(root: Path, kills: int, seed: int, time_budget_s: float = 240.0) -> dict:
    rng = random.Random(seed)
    acked: set[int] = set()
    next_i = 0
    started = time.monotonic()
    rounds = lost = wrong = duplicated = verified = 0
    for _ in range(kills):
        if time.monotonic() - started > time_budget_s:
            break
        flush_every = rng.choice([0, 0, 7, 50])
        writer = [sys.executable, "-c", WRITER, str(root), str(next_i), str(flush_every)]
        new = run_and_kill(writer, rng.uniform(0.02, 0.4))
        acked.update(new)
        last = new[-1] if new else next_i - 1
        rounds += 1
        next_i = last + 2  # the id that may have been mid-put is never reused
        records = asyncio.run(_read_all(root))
        seen: dict[int, int] = {}
        for record in records:
            seen[record["id"]] = seen.get(record["id"], 0) + 1
            verified += 1
            if {k: record.get(k) for k in ("id", "payload", "ok", "name")} != expected(
                record["id"]
            ):
                wrong += 1
        lost = sum(1 for i in acked if i not in seen)
        duplicated = sum(1 for n in seen.values() if n > 1)
        if lost or wrong or duplicated:
            break
    return {
        "harness": "queue_crash",
        "kills": rounds,
        "acknowledged_records": len(acked),
        "records_verified": verified,
        "lost_acknowledged": lost,
        "wrong_records": wrong,
        "duplicated_records": duplicated,
        "seconds": round(time.monotonic() - started, 1),
        "seed": seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp), args.kills, args.seed)
    emit(result, args.json)
    bad = result["lost_acknowledged"] + result["wrong_records"] + result["duplicated_records"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
