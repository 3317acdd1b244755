"""PersistingTier against vLLM's own ``fs`` tier, both behind vLLM's CPU tier.

Both sides run through the same vLLM code: its ``TieringOffloadingSpec`` and
``TieringOffloadingManager`` over a ``SharedOffloadRegion`` in ``/dev/shm``
(``benchmarks/vllm_tiering.py`` drives them in the engine environment). Only the secondary
tier differs: ``{"type": "PersistingTier", ...}`` (a checksum on every chunk, metadata, a
disk budget) or ``{"type": "fs", "root_dir": ...}`` (one file per chunk, written and read
with O_DIRECT where the filesystem allows it; nothing checked). For each row size
(``--row-mib``, default 0.5, 2 and 8 MiB: an MLA model's, an 8B's and a 70B's 16-token
block), each round and each side, one new engine process:

- **load**: looks up the chunks the previous round stored (a process that did not store
  them: nothing of them in its CPU tier) and waits until every one is promoted into the
  CPU tier (bytes checked afterwards, outside the timing; with ``--cold`` the page cache is
  dropped first);
- **store**: ``--chunks`` rows stored into the CPU tier as requests of ``--jobs`` chunks
  and cascaded to the tier, timed two ways from the first cascade vLLM submits: until the
  last job is done (**rows free**: vLLM's CPU-tier rows may be reused) and until
  ``os.sync()`` returned after that (**on disk**: what a tier that leaves bytes in the
  page cache still owes the disk).

Each phase also gives the CPU the engine process used in it (user and system, every
thread, until the last job was done: a store's two phases share that figure), in seconds
per GB moved: what the tier costs the engine's cores, which on a GPU host run the
scheduler beside it. The disk is settled (``os.sync()`` and ``--settle-s``) before every
timed phase, the sides alternate which goes first, every round is printed, and the ratio
is Persisting / fs of the medians. ``--option key=value`` passes a setting to the
PersistingTier (a JSON value, e.g. ``io_threads=8``). Then each side's answer to a damaged
file: a chunk whose payload file had 64 bytes flipped, promoted in a new process. Run::

    flock /tmp/persisting-bench.lock .venv/bin/python benchmarks/vllm_tier_bench.py --rounds 5
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
            **args.options,
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


def plan_for(
    side: str, root: Path, args: argparse.Namespace, steps: list[Any], row_mib: float
) -> dict[str, Any]:
    return {
        "engine_id": f"bench-{os.getpid()}-{time.monotonic_ns()}",
        "row_kib": int(row_mib * 1024),
        "world_size": 1,
        "chunks": args.chunks,
        "events": False,
        "tiers": [tier_config(side, root, args)],
        "steps": steps,
    }


def settle(seconds: float) -> dict[str, Any]:
    return {"action": "settle", "seconds": seconds}


def side_steps(r: int, root: Path, args: argparse.Namespace, store: bool) -> list[dict[str, Any]]:
    """One side's process in round ``r``: load what round ``r - 1`` stored (none in round
    0), then store round ``r``'s chunks (not after the last round)."""
    chunks = {"count": args.chunks, "jobs": args.jobs}
    steps: list[dict[str, Any]] = []
    if r > 0:
        if args.cold:
            steps.append({"action": "uncache", "dir": str(root)})
        steps += [settle(args.settle_s), {"action": "promote", "seed": 1000 + r - 1, **chunks}]
    if store:
        steps += [
            settle(args.settle_s),
            {"action": "store", "seed": 1000 + r, "sync": True, **chunks},
        ]
    return steps


def figures(row_mib: float, r: int, side: str, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed phases of one process's steps, one row each."""
    out: list[dict[str, Any]] = []
    base = {"row_mib": row_mib, "side": side, "loadavg": os.getloadavg()[0]}
    for step in steps:
        if step["action"] not in ("promote", "store"):
            continue
        cpu = step["cpu_seconds"] / (step["bytes"] / 1e9) if step["bytes"] else float("nan")
        if step["action"] == "promote":
            out.append({
                **base, "round": r - 1, "phase": "load", "seconds": step["seconds"],
                "gbps": step["bytes"] / step["seconds"] / 1e9, "cpu_s_per_gb": cpu,
                "hits": len(step["hits"]), "identical": step["identical"],
            })  # fmt: skip
        elif step["action"] == "store":
            for phase, key in (
                ("store, rows free", "seconds"),
                ("store, on disk", "synced_seconds"),
            ):
                out.append({
                    **base, "round": r, "phase": phase, "seconds": step[key],
                    "gbps": step["bytes"] / step[key] / 1e9, "cpu_s_per_gb": cpu,
                })  # fmt: skip
    return out


def one_row_size(row_mib: float, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every round of one row size: each round's process per side loads the previous
    round's chunks and stores its own; a last one loads the last round's."""
    roots = {side: work / f"row{row_mib}-{side}" for side in SIDES}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds + 1):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            steps = side_steps(r, roots[side], args, store=r < args.rounds)
            plan = plan_for(side, roots[side], args, steps, row_mib)
            out = run_plan(plan, work, f"row{row_mib}-r{r}-{side}")
            for row in figures(row_mib, r, side, out["steps"]):
                rows.append(row)
                checked = (
                    f"  hits {row['hits']}/{args.chunks} identical {row['identical']}"
                    if "hits" in row
                    else ""
                )
                print(
                    f"{row_mib:>4} MiB  round {row['round']}  {row['phase']:<16} {side:<10}"
                    f" {row['gbps']:6.2f} GB/s  {row['seconds']:.3f} s"
                    f"  CPU {row['cpu_s_per_gb']:.3f} s/GB{checked}"
                    f"  load {row['loadavg']:.2f}",
                    flush=True,
                )
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    return rows


def damaged(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """What each side does with a chunk whose file was damaged (same length)."""
    found: dict[str, Any] = {}
    count, row_mib = 4, args.row_mib[0]
    for side in SIDES:
        root = work / f"damage-{side}"
        store = [{"action": "store", "seed": 7, "count": count}]
        run_plan(plan_for(side, root, args, store, row_mib), work, f"damage-{side}-store")
        steps = [
            {"action": "damage", "dir": str(root), "files": 1},
            {"action": "promote", "seed": 7, "count": count},
            {"action": "lookup", "seed": 7, "count": count},
        ]
        out = run_plan(plan_for(side, root, args, steps, row_mib), work, f"damage-{side}-promote")
        promote, lookup = out["steps"][1], out["steps"][2]
        found[side] = {
            "promoted": len(promote["hits"]),
            "missed": len(promote["misses"]),
            "promoted_bytes_identical": promote["identical"],
            "lookups_after": lookup["results"],
        }
        shutil.rmtree(root, ignore_errors=True)
    return found


PHASES = ("store, rows free", "store, on disk", "load")


def median_of(
    rows: list[dict[str, Any]], field: str, row_mib: float, phase: str, side: str
) -> float:
    """The median ``field`` of one side's rows of one row size and phase."""
    return statistics.median(
        r[field] for r in rows if (r["row_mib"], r["phase"], r["side"]) == (row_mib, phase, side)
    )


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row size and phase: each side's median GB/s and CPU seconds per GB, and
    Persisting / fs of the GB/s."""
    out: list[dict[str, Any]] = []
    for row_mib in sorted({r["row_mib"] for r in rows}):
        for phase in PHASES:
            medians = {side: median_of(rows, "gbps", row_mib, phase, side) for side in SIDES}
            cpu = {
                f"{side}_cpu_s_per_gb": median_of(rows, "cpu_s_per_gb", row_mib, phase, side)
                for side in SIDES
            }
            ratio = medians["persisting"] / medians["fs"]
            out.append({"row_mib": row_mib, "phase": phase, **medians, "ratio": ratio, **cpu})
    return out


def option(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--row-mib", type=float, nargs="+", default=[0.5, 2.0, 8.0],
        help="bytes of one CPU-tier row (one row size after another)",
    )  # fmt: skip
    parser.add_argument("--chunks", type=int, default=256, help="rows stored and loaded")
    parser.add_argument("--jobs", type=int, default=8, help="chunks per request")
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before a load")
    parser.add_argument(
        "--option", action="append", default=[], type=option, metavar="KEY=VALUE",
        help="a PersistingTier setting (a JSON value); repeatable",
    )  # fmt: skip
    parser.add_argument("--no-damage", action="store_true", help="skip the damaged-file check")
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the tiers' roots go")
    parser.add_argument("--json", type=Path, help="write every row and the summary here")
    args = parser.parse_args()
    args.options = dict(args.option)
    work = args.dir / f"vllm-tier-bench-{os.getpid()}"
    work.mkdir(parents=True)
    print(
        f"{args.rounds} rounds of {args.chunks} rows of {args.row_mib} MiB in requests of"
        f" {args.jobs}, PersistingTier options {args.options}, under {work}"
    )
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    rows: list[dict[str, Any]] = []
    damage: dict[str, Any] = {}
    try:
        for row_mib in args.row_mib:
            rows += one_row_size(row_mib, work, args)
        if not args.no_damage:
            damage = damaged(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "rows": rows, "summary": summary(rows), "damaged": damage, "when": time.time(),
        "options": args.options, "loadavg_end": os.getloadavg(),
    }  # fmt: skip
    print(
        "| row | phase | Persisting GB/s | fs GB/s | Persisting / fs | CPU s/GB: Persisting | fs |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in result["summary"]:
        print(
            f"| {s['row_mib']:g} MiB | {s['phase']} | {s['persisting']:.2f} | {s['fs']:.2f}"
            f" | **{s['ratio']:.2f}x** | {s['persisting_cpu_s_per_gb']:.3f}"
            f" | {s['fs_cpu_s_per_gb']:.3f} |"
        )
    print(f"load average at the end: {os.getloadavg()}")
    for side, found in damage.items():
        print(f"damaged file, {side}: {found}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
