"""Damage a KV store's files in every way we can think of; the store must still open, serve
what is intact, and turn what is damaged into counted misses -- never wrong data.

    python -m tests.reliability.harness_kv_corruption [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import HEADER_BYTES
from tests.reliability.rel_common import MODEL, emit, key_text, value

N_KEYS = 8


def _payload_files(directory: Path) -> list[Path]:
    return sorted((directory / "payload").rglob("*.kv"))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _newest_manifest(directory: Path) -> Path:
    return min(
        (directory / "meta.lance" / "_versions").glob("*.manifest"), key=lambda p: int(p.stem)
    )


def _meta_data_files(directory: Path) -> list[Path]:
    return sorted(p for p in (directory / "meta.lance" / "data").iterdir() if p.is_file())


Injector = Callable[[Path, random.Random], None]

INJECTIONS: dict[str, Injector] = {
    "payload_byte_flip": lambda d, r: _flip(
        f := r.choice(_payload_files(d)),
        HEADER_BYTES + r.randrange(f.stat().st_size - HEADER_BYTES),
    ),
    "payload_header_flip": lambda d, r: _flip(r.choice(_payload_files(d)), r.randrange(8, 200)),
    "payload_truncated": lambda d, r: os.truncate(
        f := r.choice(_payload_files(d)), r.randrange(HEADER_BYTES + 1, f.stat().st_size)
    ),
    "payload_truncated_to_header": lambda d, r: os.truncate(r.choice(_payload_files(d)), 100),
    "payload_deleted": lambda d, r: r.choice(_payload_files(d)).unlink(),
    "metadata_data_byte_flip": lambda d, r: _flip(
        f := r.choice(_meta_data_files(d)), r.randrange(f.stat().st_size)
    ),
    "metadata_data_truncated": lambda d, r: os.truncate(
        f := r.choice(_meta_data_files(d)), r.randrange(f.stat().st_size)
    ),
    "metadata_data_deleted": lambda d, r: r.choice(_meta_data_files(d)).unlink(),
    "latest_manifest_damaged": lambda d, r: _newest_manifest(d).write_bytes(os.urandom(64)),
    "latest_manifest_deleted": lambda d, r: _newest_manifest(d).unlink(),
    "all_manifests_deleted": lambda d, r: [
        p.unlink() for p in (d / "meta.lance" / "_versions").iterdir()
    ],
    "usage_counter_garbled": lambda d, r: (d / "usage.bin").write_bytes(os.urandom(8)),
}


def one(root: Path, name: str, rng: random.Random) -> dict:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 30) as store:
        for start in range(0, N_KEYS, 2):  # several metadata commits (fragments, versions)
            store.batched_put(
                [key_text(i) for i in range(start, start + 2)],
                [value(i) for i in range(start, start + 2)],
                fmt="KV_2TD",
            )
            store.flush()
        directory = store.directory
    INJECTIONS[name](directory, rng)
    outcome = {
        "injection": name,
        "opened": False,
        "hits": 0,
        "misses": 0,
        "wrong": 0,
        "detected": 0,
        "put_after": False,
    }
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 30) as store:
        outcome["opened"] = True
        for i in range(N_KEYS):
            got = store.get(key_text(i))
            if got is None:
                outcome["misses"] += 1
            elif np.array_equal(got, value(i)):
                outcome["hits"] += 1
            else:
                outcome["wrong"] += 1
        store.put(key_text(100), value(100), fmt="KV_2TD")
        outcome["put_after"] = bool(np.array_equal(store.get(key_text(100)), value(100)))
        stats = store.stats()
        outcome["detected"] = stats.get("corruptions", 0)
    # And it opens again afterwards (no crash loop).
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 30) as store:
        outcome["reopened_items"] = store.stats()["disk_items"]
    return outcome


def run(rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes = []
    for r in range(rounds):
        for name in INJECTIONS:
            with tempfile.TemporaryDirectory() as tmp:
                outcomes.append(one(Path(tmp) / f"r{r}", name, rng))
    return {
        "harness": "kv_corruption",
        "injections": len(outcomes),
        "kinds": len(INJECTIONS),
        "opened": sum(o["opened"] for o in outcomes),
        "wrong_reads": sum(o["wrong"] for o in outcomes),
        "misses": sum(o["misses"] for o in outcomes),
        "intact_hits": sum(o["hits"] for o in outcomes),
        "detected": sum(o["detected"] for o in outcomes),
        "writable_after": sum(o["put_after"] for o in outcomes),
        "per_injection": outcomes,
        "seed": seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.rounds, args.seed)
    emit(result, args.json)
    ok = result["wrong_reads"] == 0 and result["opened"] == result["injections"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
