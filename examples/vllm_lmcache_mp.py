"""vLLM with LMCache's multiprocess server, Persisting as its L2 adapter: the whole recipe.

Starts ``lmcache server`` with Persisting's ``--l2-adapter`` (the command is printed), runs
a vLLM engine process with ``LMCacheMPConnector`` that stores a 1,500-token prompt, kills
the server with SIGKILL (its memory is gone), starts it again, and runs a new engine
process that reuses the prompt: what it reuses can only come from Persisting. Needs the
engine environment (vLLM 0.32 CPU build + LMCache + Persisting: ``scripts/install.sh``
builds it as ``.venv-vllm``); the model is a random-weight Llama built here. Takes a minute
or two on an idle machine (each engine process starts in 12-25 s)::

    .venv/bin/python examples/vllm_lmcache_mp.py [--engine-venv .venv-vllm]
                                                  [--storage-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 1500


def server_command(lmcache: Path, port: int, http_port: int, storage_path: Path) -> list[str]:
    """The LMCache server, with Persisting's L2 adapter from its JSON entry."""
    adapter = {
        "type": "plugin",
        "module_path": "persisting.lmcache",
        "class_name": "PersistingL2Adapter",
        "adapter_params": {"storage_path": str(storage_path), "capacity": "1GiB"},
    }
    return [
        str(lmcache), "server", "--host", "localhost", "--port", str(port),
        "--chunk-size", "256", "--l1-size-gb", "1", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "auto",  # the CPU client moves KV itself (engine_driven)
        "--l2-adapter", json.dumps(adapter),
        "--http-port", str(http_port),
    ]  # fmt: skip


#: What runs in each engine process (vLLM in its default multiprocessing mode).
ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
model, port, prompt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
if __name__ == "__main__":
    llm = LLM(
        model=model, dtype="bfloat16", enforce_eager=True, max_model_len=2048,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost",
                                       "lmcache.mp.port": port},
        ),
    )
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                          SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    print("RESULT", json.dumps({"ids": list(out.outputs[0].token_ids),
                                "cached": out.num_cached_tokens or 0}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", LMCACHE_LOG_LEVEL="WARNING")
    env["PYTHONPATH"] = str(REPO)
    return env


def start_server(command: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        server = subprocess.Popen(command, env=engine_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"the LMCache server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def run_engine(python: Path, model: Path, port: int, prompt: list[int]) -> dict[str, object]:
    proc = subprocess.run(
        [str(python), "-c", ENGINE, str(model), str(port), json.dumps(prompt)],
        env=engine_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the engine failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result: dict[str, object] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def l2_files(storage_path: Path) -> int:
    return sum(1 for p in (storage_path / "kv").rglob("*") if p.is_file() and "payload" in p.parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine-venv", type=Path, default=REPO / ".venv-vllm")
    parser.add_argument("--storage-path", type=Path)
    args = parser.parse_args()
    python, lmcache = args.engine_venv / "bin" / "python", args.engine_venv / "bin" / "lmcache"
    if not python.exists():
        raise SystemExit(f"no engine environment at {args.engine_venv}: run scripts/install.sh")
    with tempfile.TemporaryDirectory(prefix="vllm-lmcache-mp-") as tmp:
        work = Path(tmp)
        storage = args.storage_path or work / "root"
        model = work / "llama"
        kit = REPO / "benchmarks" / "vllm_engine.py"
        subprocess.run([str(python), str(kit), "model", str(model)], env=engine_env(),
                       check=True, capture_output=True)  # fmt: skip
        sys.path.insert(0, str(REPO / "benchmarks"))
        from vllm_engine import prompt_ids  # the engine kit's deterministic prompts

        prompt = prompt_ids(PROMPT_TOKENS, 1)
        port = free_port()
        command = server_command(lmcache, port, free_port(), storage)
        print("starting:", " ".join(command[:-4]), "--l2-adapter '<Persisting JSON>' ...")
        server = start_server(command, port, work / "server.log")
        try:
            first = run_engine(python, model, port, prompt)
            print(f"first engine: reused {first['cached']} of {PROMPT_TOKENS} prompt tokens")
            deadline = time.monotonic() + 120
            while l2_files(storage) < PROMPT_TOKENS // 256 and time.monotonic() < deadline:
                time.sleep(0.1)  # LMCache writes L2 behind the request
            print(f"chunks in Persisting: {l2_files(storage)}")
        finally:
            server.send_signal(signal.SIGKILL)
            server.wait()
        print("server killed (SIGKILL) and started again: its L1 memory is empty")
        server = start_server(command, port, work / "server.log")
        try:
            second = run_engine(python, model, port, prompt)
        finally:
            server.send_signal(signal.SIGKILL)
            server.wait()
        print(f"new engine: reused {second['cached']} of {PROMPT_TOKENS} prompt tokens")
        print(f"same greedy token ids: {second['ids'] == first['ids']}")
    print("vllm_lmcache_mp: done")


if __name__ == "__main__":
    main()
