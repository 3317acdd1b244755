"""Persisting against SGLang's own file backend (``HiCacheFile``) as HiCache's L3 tier.

Both sides run SGLang's own code in ``.venv-sglang`` (``benchmarks/sglang_kit.py``): the
same host pool class and shape, pages of a realistic size (default: an 8B-class model,
32 layers x 8 KV heads x 128 dims, bf16, 64 tokens a page: 8 MiB a page), each side in a
fresh process per round, as SGLang's cache controller drives it:

- Persisting through the zero-copy pair (``"interface_v1": 1``: ``batch_set_v1`` /
  ``batch_get_v1`` over host indices), pages checksummed, under a disk budget;
- HiCacheFile through the controller's generic path (``get_data_page`` + ``batch_set``;
  ``get_dummy_flat_data_page`` + ``batch_get`` + ``set_from_flat_data_page``), with its LRU
  bound on (``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE``, the same bytes as the budget).

Per round and side: pages set per second, then got per second with the page cache warm,
then cold (page cache dropped), each timed phase after ``os.sync()`` and a pause, in
batches of ``--batch`` pages; the pages read back are compared with what was written.
The side that goes first alternates by round; every row is printed, then the medians and
the ratio Persisting / HiCacheFile. Then what each does with a damaged page (one byte
flipped in its file) and after a restart (a new process reading the pages).

    flock /tmp/persisting-bench.lock .venv/bin/python benchmarks/sglang_l3_bench.py --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv-sglang" / "bin" / "python"
KIT = REPO / "benchmarks" / "sglang_kit.py"
SIDES = ("persisting", "hicache_file")


def page_keys(count: int, seed: int) -> list[str]:
    """Chained SHA-256 hex digests, the shape of SGLang's page hashes."""
    keys, prior = [], hashlib.sha256(f"bench{seed}".encode()).digest()
    for i in range(count):
        prior = hashlib.sha256(prior + i.to_bytes(8, "little")).digest()
        keys.append(prior.hex())
    return keys


def backend(side: str, storage: Path, budget: int) -> dict[str, Any]:
    if side == "persisting":
        extra = {
            "backend_name": "persisting",
            "module_path": "persisting.integrations.sglang",
            "class_name": "PersistingHiCacheStorage",
            "interface_v1": 1,
            "storage_path": str(storage),
            "disk_bytes": budget,
            "model_version": "bench",
        }
        return {"name": "dynamic", "extra": extra}
    return {"name": "file", "dir": str(storage), "max_bytes": budget}


def run(plan: dict[str, Any], work: Path, name: str) -> list[Any]:
    plan_file, out_file = work / f"{name}.plan.json", work / f"{name}.out.json"
    plan_file.write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG_"))}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [str(PYTHON), str(KIT), "run", str(plan_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not out_file.exists():
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    out = json.loads(out_file.read_text())
    if "build_error" in out:
        sys.exit(f"{name}: {out['build_error']}")
    errors = [s for s in out["steps"] if isinstance(s, dict) and "error" in s]
    if errors:
        sys.exit(f"{name}: {errors[0]}")
    return list(out["steps"])


def batches(keys: list[str], size: int) -> list[tuple[list[str], list[int]]]:
    return [
        (keys[i : i + size], list(range(i, min(i + size, len(keys)))))
        for i in range(0, len(keys), size)
    ]


def one_round(side: str, args: argparse.Namespace, work: Path, seed: int) -> dict[str, float]:
    """One side's round in a fresh process: set, warm get, cold get (each timed)."""
    storage = work / f"{side}-store"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(mode=0o700)
    keys = page_keys(args.pages, seed)
    slots = list(range(args.pages))
    chunks = batches(keys, args.batch)
    settle = {"do": "settle", "seconds": args.settle}

    def timed(do: str) -> list[dict[str, Any]]:
        return [{"do": "timed", "step": {"do": do, "keys": k, "slots": s}} for k, s in chunks]

    steps: list[dict[str, Any]] = []
    marks: dict[str, slice] = {}

    def add(name: str, *more: dict[str, Any]) -> None:
        marks[name] = slice(len(steps), len(steps) + len(more))
        steps.extend(more)

    add("fill", {"do": "fill", "slots": slots, "seed": seed})
    add("written", {"do": "digest", "slots": slots})
    add("settle", settle)
    add("set", *timed("set"))
    add("settle", settle, {"do": "zero"})
    add("warm", *timed("get"))
    add("warm_digest", {"do": "digest", "slots": slots})
    add("uncache", {"do": "zero"}, {"do": "uncache", "dir": str(storage)}, settle)
    add("cold", *timed("get"))
    add("cold_digest", {"do": "digest", "slots": slots})
    plan = {"pool": pool(args), "backend": backend(side, storage, args.budget), "steps": steps}
    out = run(plan, work, f"{side}-{seed}")
    written, sets = out[marks["written"]][0], out[marks["set"]]
    warm, warm_digest = out[marks["warm"]], out[marks["warm_digest"]][0]
    cold, cold_digest = out[marks["cold"]], out[marks["cold_digest"]][0]
    for phase, results in (("set", sets), ("warm get", warm), ("cold get", cold)):
        for r in results:
            ok = r["result"] if isinstance(r["result"], list) else [r["result"]]
            if not all(ok):
                sys.exit(f"{side}: a {phase} failed: {ok}")
    if warm_digest != written or cold_digest != written:
        sys.exit(f"{side}: pages read back differ from the pages written")
    return {
        "set": args.pages / sum(r["seconds"] for r in sets),
        "warm_get": args.pages / sum(r["seconds"] for r in warm),
        "cold_get": args.pages / sum(r["seconds"] for r in cold),
    }


def pool(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kind": "mha",
        "layout": args.layout,
        "layers": args.layers,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "page_size": args.page_size,
        "pages": args.pages,
    }


def faults(side: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Write 8 pages, flip a byte in page 3's file, then read them in a new process."""
    storage = work / f"{side}-faults"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(mode=0o700)
    keys, slots = page_keys(8, 99), list(range(8))
    small = {**pool(args), "pages": 8}
    spec = backend(side, storage, args.budget)
    out = run(
        {
            "pool": small,
            "backend": spec,
            "steps": [
                {"do": "fill", "slots": slots, "seed": 7},
                {"do": "digest", "slots": slots},
                {"do": "set", "keys": keys, "slots": slots},
            ],
        },
        work,
        f"{side}-faults-write",
    )
    written = out[1]
    flip(side, storage, keys[3])
    again = run(
        {
            "pool": small,
            "backend": spec,
            "steps": [
                {"do": "exists", "keys": keys},
                {"do": "get", "keys": keys, "slots": slots},
                {"do": "digest", "slots": slots},
                {"do": "exists", "keys": keys},
            ],
        },
        work,
        f"{side}-faults-read",
    )
    got = again[1] if isinstance(again[1], list) else [again[1]] * 8
    return {
        "restart: pages found": again[0],
        "damaged page returned as a hit": bool(got[3]),
        "damaged page's bytes wrong in the host pool": again[2][3] != written[3],
        "other pages bit-exact": all(again[2][i] == written[i] for i in range(8) if i != 3),
        "pages found after the read": again[3],
    }


def flip(side: str, storage: Path, key: str) -> None:
    """Flip a byte in the middle of the file holding ``key``'s page."""
    if side == "hicache_file":
        (path,) = [p for p in storage.iterdir() if p.name.startswith(key)]
        offset = path.stat().st_size // 2
    else:  # the payload file whose header names the key (read as any reader of the root)
        path, offset = _persisting_file(storage, key)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _persisting_file(storage: Path, key: str) -> tuple[Path, int]:
    for path in (storage / "kv").glob("sglang.*/payload/*/*.kv"):
        head = path.read_bytes()[:4096]
        (length,) = struct.unpack_from("<I", head, 8)  # magic, body length, body hash, body
        if json.loads(head[20 : 20 + length])["key"].split("@")[3] == key:
            return path, 4096 + (path.stat().st_size - 4096) // 2
    raise SystemExit(f"no payload file holds {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pages", type=int, default=48, help="pages per round")
    parser.add_argument("--batch", type=int, default=16, help="pages per call")
    parser.add_argument("--layout", default="page_first", choices=("page_first", "layer_first"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=4 << 30, help="disk bytes per side")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after os.sync()")
    parser.add_argument("--work", type=Path, default=None, help="directory for the stores")
    args = parser.parse_args()
    page = 2 * args.layers * args.heads * args.head_dim * 2 * args.page_size
    work = Path(tempfile.mkdtemp(prefix="sglang-l3-", dir=args.work))
    print(
        f"# pages of {page / 2**20:.1f} MiB ({args.layout}), {args.pages} per round in "
        f"batches of {args.batch}; load average {os.getloadavg()[0]:.2f}"
    )
    rows: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    try:
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                row = one_round(side, args, work, seed=r)
                rows[side].append(row)
                print(
                    f"round {r} {side:12s} "
                    + "  ".join(f"{k} {v:7.1f} pages/s" for k, v in row.items()),
                    flush=True,
                )
        print(f"# load average {os.getloadavg()[0]:.2f}")
        for metric in ("set", "warm_get", "cold_get"):
            medians = {s: statistics.median(x[metric] for x in rows[s]) for s in SIDES}
            ratio = medians["persisting"] / medians["hicache_file"]
            print(
                f"median {metric:8s} persisting {medians['persisting']:7.1f}  hicache_file "
                f"{medians['hicache_file']:7.1f} pages/s  ratio {ratio:.2f}x "
                f"({medians['persisting'] * page / 2**30:.2f} vs "
                f"{medians['hicache_file'] * page / 2**30:.2f} GiB/s)"
            )
        for side in SIDES:
            print(f"faults {side}: {json.dumps(faults(side, args, work))}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
