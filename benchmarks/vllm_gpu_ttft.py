"""Time to first token on a GPU: a prompt restored by a NEW vLLM engine process through
PersistingConnector (vLLM's CPU tier in front of PersistingTier), against recomputing it
and against vLLM's own ``fs`` tier behind the same CPU tier.

    python3 benchmarks/vllm_gpu_ttft.py [--tokens 8192] [--layers 8] [--hidden 2048]
                                        [--rounds 2] [--work /tmp] [--json out.json]

Run on a GPU machine whose Python has vLLM (CUDA build) and Persisting's dependencies
(``scripts/gpu_check.sh`` calls it). A random-weight Llama is built there (no download).
Each round and side, on a fresh directory: an engine computes the prompt (its time to
first token is a ``recompute`` sample: nothing was stored yet), stores it and exits; a new
engine process restores it (``restore``), and greedy ids of both are compared. Sides
alternate; the disk is settled before each timed request; each engine first runs a short
unrelated prompt so that warm-up is not timed. Every row is printed, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "benchmarks" / "vllm_engine.py"
SIDES = ("persisting", "fs")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU")}
    env.pop("VLLM_TARGET_DEVICE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _run(args: list[str], log: Path) -> None:
    with open(log, "wb") as out:
        code = subprocess.run(
            [sys.executable, str(KIT), *args], env=_env(), stdout=out, stderr=subprocess.STDOUT
        ).returncode
    if code != 0:
        raise SystemExit(f"{args[0]} failed ({code}): see {log}")


def _engine(plan: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    plan_file, out_file = work / f"{name}.plan.json", work / f"{name}.out.json"
    plan_file.write_text(json.dumps(plan))
    _run(["run", str(plan_file), str(out_file)], work / f"{name}.log")
    return json.loads(out_file.read_text())


def _connector(side: str, directory: Path) -> dict[str, Any]:
    if side == "persisting":
        extra = {"storage_path": str(directory), "cpu_bytes": "4GiB", "model_version": "bench"}
        return {"kind": "persisting", "extra": extra}
    return {"kind": "tiering-fs", "dir": str(directory), "cpu_bytes": 4 << 30}


def one(side: str, model: Path, work: Path, args: argparse.Namespace, r: int) -> dict[str, Any]:
    directory = work / f"{side}-{r}"
    plan = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": args.tokens + 64,
        "gpu_memory_utilization": 0.5,
        "connector": _connector(side, directory),
    }
    warm = {"name": "warm", "prompt": [64, 99], "max_tokens": 1}
    timed = {"name": "ttft", "prompt": [args.tokens, 1], "max_tokens": 1}
    ids = {"name": "ids", "prompt": [args.tokens, 1], "max_tokens": 8}
    settle = {"action": "settle", "seconds": 3}
    first = _engine(
        {**plan, "steps": [warm, settle, timed, ids, {"action": "settle", "seconds": 5}]},
        work,
        f"{side}-{r}-first",
    )
    second = _engine({**plan, "steps": [warm, settle, timed, ids]}, work, f"{side}-{r}-second")
    got = {s["name"]: s for s in first["steps"] if "name" in s}
    back = {s["name"]: s for s in second["steps"] if "name" in s}
    return {
        "round": r,
        "side": side,
        "recompute_s": got["ttft"]["seconds"],
        "restore_s": back["ttft"]["seconds"],
        "reused_tokens": back["ttft"]["cached"],
        "same_ids": back["ids"]["ids"] == got["ids"]["ids"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("vLLM is not installed: carry its CUDA wheels (gpu_check.sh)") from None
    work = Path(tempfile.mkdtemp(prefix="vllm-gpu-ttft-", dir=args.work))
    model = work / "model"
    heads = max(args.hidden // 128, 1)
    _run(
        ["model", str(model), "--layers", str(args.layers), "--hidden", str(args.hidden),
         "--heads", str(heads), "--kv-heads", str(max(heads // 4, 1)),
         "--max-len", str(args.tokens + 64)],
        work / "model.log",
    )  # fmt: skip
    rows = []
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            row = one(side, model, work, args, r)
            rows.append(row)
            print(
                f"round {r} {side:<10} recompute {row['recompute_s']:.3f} s  restore"
                f" {row['restore_s']:.3f} s  reused {row['reused_tokens']}/{args.tokens}"
                f"  same ids {row['same_ids']}",
                flush=True,
            )
    summary = {
        side: {
            key: statistics.median(r[key] for r in rows if r["side"] == side)
            for key in ("recompute_s", "restore_s")
        }
        for side in SIDES
    }
    for side, figures in summary.items():
        print(f"median {side}: {figures}")
    print(
        "restore, persisting / fs:"
        f" {summary['persisting']['restore_s'] / summary['fs']['restore_s']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary, "when": time.time()}))


if __name__ == "__main__":
    main()
