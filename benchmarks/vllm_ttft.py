"""Time to first token of a long prompt restored by a NEW vLLM engine process, against
recomputing it: Persisting's connector, a naive file-per-block connector and LMCache MP.

    .venv/bin/python benchmarks/vllm_ttft.py [--tokens 3000] [--layers 6] [--hidden 768]
                                             [--rounds 2] [--cold] [--json out.json]

Runs real vLLM engines (CPU build) from the engine environment ``.venv-vllm`` (built by
``scripts/install.sh``) on a random-weight Llama built here (no download). Each side, each
round, on a fresh storage directory:

- ``persisting``: an engine with PersistingConnector computes the prompt (its TTFT is a
  ``recompute`` sample: nothing was stored) and stores it; it exits; a new engine process
  restores it (``restore`` TTFT);
- ``naive``: the same with ``NaiveFileSpec`` (benchmarks/vllm_engine.py): vLLM's
  OffloadingConnector over one file per block, read with one ``preadv`` into the block's
  rows, no index, no checksum -- the floor a file tier can reach;
- ``lmcache``: an ``lmcache server`` with LMCache's own ``fs`` L2 adapter and vLLM's
  LMCacheMPConnector; between the storing engine and the restoring one the server is
  SIGKILLed and restarted, so the chunks come from the L2 adapter, not LMCache's memory.

Sides alternate order from round to round; before each timed request the disk is settled
(``os.sync()`` and a pause: these virtual disks keep flushing long after a write), and with
``--cold`` the block files are dropped from the page cache (``posix_fadvise(DONTNEED)``).
Each engine first runs a short unrelated prompt, so one-time warm-up is not in the TTFT.
TTFT is the wall time of ``generate`` with ``max_tokens=1``. Every row is printed, with
the reused tokens and whether the restored first tokens equal the recomputed ones, then the
medians and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
KIT = REPO / "benchmarks" / "vllm_engine.py"
SIDES = ("persisting", "naive", "lmcache")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # benchmarks/ too: vLLM imports the naive baseline spec (naive_file_spec) by module name.
    paths = f"{REPO}{os.pathsep}{REPO / 'benchmarks'}"
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2", PYTHONPATH=paths)
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(plan: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    plan_file, out_file = work / f"{name}.plan.json", work / f"{name}.out.json"
    plan_file.write_text(json.dumps(plan))
    with open(work / f"{name}.log", "wb") as log:
        proc = subprocess.run(
            [str(ENGINE_PYTHON), str(KIT), "run", str(plan_file), str(out_file)],
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if proc.returncode != 0:
        raise SystemExit(f"engine {name} failed; see {work / (name + '.log')}")
    return json.loads(out_file.read_text())


class LMCacheServer:
    """``lmcache server`` with LMCache's own ``fs`` L2 adapter (the peer)."""

    def __init__(self, port: int, directory: Path, log: Path):
        self.port, self.directory, self.log = port, directory, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        adapter = {"type": "fs", "base_path": str(self.directory)}
        command = [str(REPO / ".venv-vllm" / "bin" / "lmcache"), "server", "--host", "localhost"]
        command += ["--port", str(self.port), "--chunk-size", "256", "--l1-size-gb", "2"]
        command += ["--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
        command += ["--l2-adapter", json.dumps(adapter), "--http-port", str(_port())]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(command, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"lmcache server did not start; see {self.log}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


def _steps(prompt: list[int], settle_s: float, cold_dir: Path | None) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [{"name": "warmup", "prompt": [64, 999], "max_tokens": 1}]
    steps.append({"action": "settle", "seconds": settle_s})
    if cold_dir is not None:
        steps.append({"action": "uncache", "dir": str(cold_dir)})
    steps.append({"name": "ttft", "prompt": prompt, "max_tokens": 1})
    return steps


def run_side(side: str, args: argparse.Namespace, model: Path, work: Path) -> dict[str, Any]:
    data = work / f"{side}-data"
    plan: dict[str, Any] = {"model": str(model), "max_model_len": args.tokens + 256}
    server: LMCacheServer | None = None
    if side == "persisting":
        extra = {"storage_path": str(data), "disk_bytes": "8GiB", "fsync": False}
        plan["connector"] = {"kind": "persisting", "extra": extra}
        files, count = data / "kv", args.tokens // 128
    elif side == "naive":
        plan["connector"] = {"kind": "naive", "dir": str(data)}
        files, count = data, args.tokens // 128
    else:
        server = LMCacheServer(_port(), data, work / "lmcache-server.log")
        server.start()
        plan["connector"] = {"kind": "lmcache", "port": server.port}
        files, count = data, args.tokens // 256
    prompt = [args.tokens, 1]
    try:
        stored = _engine(
            {
                **plan,
                "steps": [
                    *_steps(prompt, args.settle_s, None),
                    {"action": "wait_files", "dir": str(files), "count": count, "timeout": 600},
                ],
            },
            work,
            f"{side}-store",
        )
        if server is not None:  # chunks must now come from the L2 adapter, not L1
            server.kill()
            server.start()
        cold = files if args.cold else None
        restored = _engine(
            {**plan, "steps": _steps(prompt, args.settle_s, cold)}, work, f"{side}-restore"
        )
    finally:
        if server is not None:
            server.kill()
    first = next(s for s in stored["steps"] if s.get("name") == "ttft")
    again = next(s for s in restored["steps"] if s.get("name") == "ttft")
    return {
        "side": side,
        "recompute_s": first["seconds"],
        "restore_s": again["seconds"],
        "reused_tokens": again["cached"],
        "same_first_token": again["ids"] == first["ids"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--cold", action="store_true", help="drop block files from page cache")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--work", type=Path, help="keep models, data and logs here")
    args = parser.parse_args(argv)
    if not ENGINE_PYTHON.exists():
        raise SystemExit(
            f"no engine environment at {ENGINE_PYTHON.parent.parent}: run scripts/install.sh"
        )
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "model"
        shape = ["--layers", str(args.layers), "--hidden", str(args.hidden)]
        shape += ["--heads", str(args.heads), "--kv-heads", str(args.heads)]
        subprocess.run(
            [
                str(ENGINE_PYTHON),
                str(KIT),
                "model",
                str(model),
                *shape,
                "--max-len",
                str(args.tokens + 256),
            ],
            env=_env(),
            check=True,
            capture_output=True,
        )
        rows: list[dict[str, Any]] = []
        print(f"prompt {args.tokens} tokens, {args.layers} layers, hidden {args.hidden}")
        print(f"# load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", flush=True)
        print(f"{'round':>5} {'side':>10} {'recompute s':>12} {'restore s':>10} {'reused':>7} same")
        for round_no in range(args.rounds):
            sides = (
                args.sides[round_no % len(args.sides) :] + args.sides[: round_no % len(args.sides)]
            )
            for side in sides:
                side_work = work / f"r{round_no}"
                side_work.mkdir(exist_ok=True)
                row = {"round": round_no, **run_side(side, args, model, side_work)}
                rows.append(row)
                print(
                    f"{round_no:>5} {side:>10} {row['recompute_s']:>12.3f}"
                    f" {row['restore_s']:>10.3f} {row['reused_tokens']:>7}"
                    f" {row['same_first_token']}",
                    flush=True,
                )
    print(f"# load average {os.getloadavg()[0]:.2f}")
    recompute = statistics.median(r["recompute_s"] for r in rows)
    summary: dict[str, Any] = {"recompute_s": recompute}
    for side in args.sides:
        restore = statistics.median(r["restore_s"] for r in rows if r["side"] == side)
        summary[f"{side}_restore_s"] = restore
        summary[f"{side}_cut"] = 1 - restore / recompute
        cut = 100 * (1 - restore / recompute)
        print(f"{side}: restore {restore:.3f} s, {cut:.1f}% below recompute {recompute:.3f} s")
    for peer in ("naive", "lmcache"):
        if "persisting" in args.sides and peer in args.sides:
            ratio = summary["persisting_restore_s"] / summary[f"{peer}_restore_s"]
            summary[f"persisting_over_{peer}"] = ratio
            print(f"persisting / {peer} restore TTFT: {ratio:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
