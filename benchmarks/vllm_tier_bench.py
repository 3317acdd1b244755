"""PersistingTier against vLLM's own ``fs`` tier, both behind vLLM's CPU tier.

Both sides run through the same vLLM code: its ``TieringOffloadingSpec`` and
``TieringOffloadingManager`` over a ``SharedOffloadRegion`` in ``/dev/shm``
(``benchmarks/vllm_tiering.py`` drives them, one engine process per phase, in the engine
environment). Only the secondary tier differs: ``{"type": "PersistingTier", ...}`` (a
checksum on every chunk, metadata, a disk budget) or ``{"type": "fs", "root_dir": ...}``
(one file per chunk, written and read with O_DIRECT where the filesystem allows it;
nothing checked). Per round and side:

- **cascade**: ``--chunks`` rows of ``--row-mib`` MiB stored into the CPU tier as
  ``--jobs`` requests, timed from the first cascade vLLM submits to the last one finished;
- **promote, warm**: a new process looks them up and waits until every one is promoted
  into the CPU tier (bytes checked afterwards, outside the timing); the files were just
  written, so a tier that reads through the page cache finds them there (both tiers read
  with O_DIRECT where the filesystem allows it, so neither does);
- **promote, cold**: the page cache dropped first (``drop_caches`` as root, else
  ``posix_fadvise(DONTNEED)`` on the side's files), then the same in a new process.

The disk is settled (``os.sync()`` and ``--settle-s``) before every timed phase, sides
alternate which goes first, every round is printed, and the ratio is Persisting / fs of
the medians. Then each side's answer to a damaged file: a chunk whose payload file had 64
bytes flipped, promoted in a new process. Run::

    flock /work/bench.lock .venv/bin/python benchmarks/vllm_tier_bench.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = REPO / "benchmarks" / "vllm_tiering.py"
SIDES = ("persisting", "fs")


def tier_config(side: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    if side == "persisting":
        return {
            "type": "PersistingTier",
            "module_path": "persisting.integrations.vllm",
            "storage_path": str(root),
            "disk_bytes": "64GiB",
            "model_version": "bench",
        }
    return {"type": "fs", "root_dir": str(root)}


def run_plan(plan: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    plan_file, out_file, log_file = (
        work / f"{name}.{ext}" for ext in ("plan.json", "out.json", "log")
    )
    plan_file.write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(REPO)
    with open(log_file, "wb") as log:
        proc = subprocess.run(
            [str(ENGINE_PYTHON), str(DRIVER), str(plan_file), str(out_file)],
            env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{name} exited {proc.returncode}: see {log_file}")
    return json.loads(out_file.read_text())


def plan_for(side: str, root: Path, args: argparse.Namespace, steps: list[Any]) -> dict[str, Any]:
    return {
        "engine_id": f"bench-{os.getpid()}-{time.monotonic_ns()}",
        "row_kib": int(args.row_mib * 1024),
        "world_size": 1,
        "chunks": args.chunks,
        "events": False,
        "tiers": [tier_config(side, root, args)],
        "steps": steps,
    }


def settle(seconds: float) -> dict[str, Any]:
    return {"action": "settle", "seconds": seconds}


def one_round(r: int, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    sides = SIDES if r % 2 == 0 else SIDES[::-1]
    roots = {side: work / f"round{r}-{side}" for side in sides}
    chunks = {"seed": 1000 + r, "count": args.chunks, "jobs": args.jobs}
    rows: list[dict[str, Any]] = []
    phases = (
        ("cascade", "store", []),
        ("promote warm", "promote", []),
        ("promote cold", "promote", [{"action": "uncache", "dir": "ROOT"}]),
    )
    for phase, action, before in phases:
        for side in sides:
            root = roots[side]
            first = [{**s, "dir": str(root)} for s in before]
            steps = [*first, settle(args.settle_s), {"action": action, **chunks}]
            name = f"r{r}-{side}-{phase.replace(' ', '-')}"
            out = run_plan(plan_for(side, root, args, steps), work, name)
            result = out["steps"][-1]
            row = {
                "round": r,
                "phase": phase,
                "side": side,
                "seconds": result["seconds"],
                "gbps": result["bytes"] / result["seconds"] / 1e9,
                "loadavg": os.getloadavg()[0],
            }
            if action == "promote":
                row["hits"] = len(result["hits"])
                row["identical"] = result["identical"]
            rows.append(row)
            checked = (
                f"  hits {row['hits']}/{args.chunks} identical {row['identical']}"
                if "hits" in row
                else ""
            )
            print(
                f"round {r}  {phase:<13} {side:<10} {row['gbps']:6.2f} GB/s"
                f"  {row['seconds']:.3f} s{checked}  load {row['loadavg']:.2f}",
                flush=True,
            )
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    return rows


def damaged(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """What each side does with a chunk whose file was damaged (same length)."""
    found: dict[str, Any] = {}
    count = 4
    for side in SIDES:
        root = work / f"damage-{side}"
        store = [{"action": "store", "seed": 7, "count": count}]
        run_plan(plan_for(side, root, args, store), work, f"damage-{side}-store")
        steps = [
            {"action": "damage", "dir": str(root), "files": 1},
            {"action": "promote", "seed": 7, "count": count},
            {"action": "lookup", "seed": 7, "count": count},
        ]
        out = run_plan(plan_for(side, root, args, steps), work, f"damage-{side}-promote")
        promote, lookup = out["steps"][1], out["steps"][2]
        found[side] = {
            "promoted": len(promote["hits"]),
            "missed": len(promote["misses"]),
            "promoted_bytes_identical": promote["identical"],
            "lookups_after": lookup["results"],
        }
        shutil.rmtree(root, ignore_errors=True)
    return found


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("cascade", "promote warm", "promote cold"):
        medians = {
            side: statistics.median(
                r["gbps"] for r in rows if r["phase"] == phase and r["side"] == side
            )
            for side in SIDES
        }
        out[phase] = {**medians, "ratio": medians["persisting"] / medians["fs"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--row-mib", type=float, default=4.0, help="bytes of one CPU-tier row")
    parser.add_argument("--chunks", type=int, default=64, help="rows cascaded and promoted")
    parser.add_argument("--jobs", type=int, default=8, help="requests the rows are split into")
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the tiers' roots go")
    parser.add_argument("--json", type=Path, help="write every row and the summary here")
    args = parser.parse_args()
    work = args.dir / f"vllm-tier-bench-{os.getpid()}"
    work.mkdir(parents=True)
    print(
        f"{args.rounds} rounds, {args.chunks} rows of {args.row_mib} MiB in {args.jobs} jobs,"
        f" under {work}"
    )
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            rows += one_round(r, work, args)
        damage = damaged(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"rows": rows, "summary": summary(rows), "damaged": damage, "when": time.time()}
    for phase, figures in result["summary"].items():
        print(
            f"{phase:<13} median persisting {figures['persisting']:.2f} GB/s, fs"
            f" {figures['fs']:.2f} GB/s: {figures['ratio']:.2f}x"
        )
    for side, found in damage.items():
        print(f"damaged file, {side}: {found}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
