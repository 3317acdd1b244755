"""A real SGLang server with Persisting as its HiCache L3 tier: for a GPU machine.

No SGLang engine runs on a CPU-only host, so the SGLang tests drive SGLang's storage
classes without an engine (``tests/sglang/``). On a machine with a CUDA GPU and SGLang
installed, this script adds what only an engine shows (``scripts/gpu_check.sh`` runs it):

1. builds a random-weight Llama (``benchmarks/vllm_engine.py model``: no download);
2. starts ``python -m sglang.launch_server`` with ``--enable-hierarchical-cache
   --hicache-storage-backend dynamic`` and Persisting's extra config (``interface_v1``);
3. sends a long prompt of token ids and waits for its pages to be backed up to L3
   (the namespace's payload files appear);
4. stops the server (SIGTERM), starts a new one on the same root, sends the same prompt:
   with GPU and host caches empty, any cached tokens come from Persisting (reported by
   SGLang as ``meta_info.cached_tokens``), and the greedy output must be the same.

Prints one JSON line: tokens cached after the restart, both outputs, the seconds each
request took. Exit status 0 when the restarted server reused the prefix and answered the
same; 2 when SGLang is not installed here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def start(model: Path, root: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    extra = {
        "backend_name": "persisting",
        "module_path": "persisting.integrations.sglang",
        "class_name": "PersistingHiCacheStorage",
        "interface_v1": 1,
        "storage_path": str(root),
        "disk_bytes": "8GiB",
        "model_version": "random-weights",
    }
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--port",
        str(port),
        "--page-size",
        "64",
        "--enable-hierarchical-cache",
        "--hicache-write-policy",
        "write_through",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
        "--mem-fraction-static",
        "0.5",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited {proc.returncode}; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    sys.exit(f"server did not come up; see {log}")


def generate(port: int, ids: list[int]) -> tuple[dict[str, Any], float]:
    body = json.dumps(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        out = json.loads(reply.read())
    return out, time.perf_counter() - start


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="sgl-l3-")))
    args = parser.parse_args()
    try:
        import sglang  # noqa: F401
    except ImportError:
        print(json.dumps({"skipped": "SGLang is not installed in this environment"}))
        sys.exit(2)
    model, root, log = args.work / "model", args.work / "root", args.work / "server.log"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "vllm_engine.py"),
            "model",
            str(model),
            "--layers",
            "4",
            "--hidden",
            "1024",
            "--max-len",
            str(args.tokens + 256),
        ],
        check=True,
    )
    ids = [10 + (i * 7919) % 4000 for i in range(args.tokens)]  # inside the vocabulary
    server = start(model, root, args.port, log)
    first, first_s = generate(args.port, ids)
    deadline = time.monotonic() + 120  # write-through backups land after the request
    while time.monotonic() < deadline and not list(root.glob("kv/sglang.*/payload/*/*.kv")):
        time.sleep(1)
    time.sleep(5)
    stop(server)
    server = start(model, root, args.port, log)
    second, second_s = generate(args.port, ids)
    stop(server)
    cached = int(second.get("meta_info", {}).get("cached_tokens", 0))
    result = {
        "prompt_tokens": args.tokens,
        "cached_tokens_after_restart": cached,
        "same_output": first.get("output_ids", first.get("text"))
        == second.get("output_ids", second.get("text")),
        "first_request_s": round(first_s, 3),
        "after_restart_s": round(second_s, 3),
        "payload_files": len(list(root.glob("kv/sglang.*/payload/*/*.kv"))),
    }
    print(json.dumps(result))
    sys.exit(0 if cached > 0 and result["same_output"] else 1)


if __name__ == "__main__":
    main()
