"""Running real vLLM engines (CPU build) in the engine environment, from the tests.

The engine environment is ``.venv-vllm`` at the repository root (built by
``scripts/install.sh`` through ``scripts/install_engine_env.sh``); each engine is a process
of ``benchmarks/vllm_engine.py`` running a JSON plan (see its docstring).

Beside it, ``.venv-vllm-0.34``: vLLM 0.34.0 -- the wheel GPU users install from PyPI --
installed without its dependencies over ``.venv-vllm``'s (:data:`ENGINES`). Its Python
classes run on the CPU, its engine does not (no CPU build of 0.34; its CUDA wheel's CPU
platform wants triton-cpu): the tests of vLLM's tiering and of the connector's worker run
against both versions, the engine runs against 0.32 only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINE_VENV = REPO / ".venv-vllm"
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"
#: The vLLM versions the engine-free engine tests run against, and their environments.
ENGINES = {"0.32": ENGINE_VENV, "0.34": REPO / ".venv-vllm-0.34"}
VLLM_VERSIONS = tuple(ENGINES)
ENGINE_KIT = REPO / "benchmarks" / "vllm_engine.py"
TIERING_KIT = REPO / "benchmarks" / "vllm_tiering.py"
#: Tokens per CPU KV block (vLLM's CPU backend default).
BLOCK = 128


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", LMCACHE_LOG_LEVEL="WARNING")
    env["PYTHONPATH"] = str(REPO)  # this checkout's Persisting, as the editable install says
    return env


def prompt_ids(length: int, seed: int) -> list[int]:
    """The prompt ``benchmarks/vllm_engine.py`` builds for ``[length, seed]``."""
    import numpy as np

    vocab = 4096  # the test models' vocabulary (vllm_engine.VOCAB)
    return [int(t) for t in np.random.default_rng(seed).integers(4, vocab, length)]


def require_engine(version: str = "0.32") -> Path:
    """The Python of vLLM ``version``'s engine environment (AssertionError if not built)."""
    python = ENGINES[version] / "bin" / "python"
    if not python.exists():
        raise AssertionError(
            f"no engine environment at {ENGINES[version]}: run bash scripts/install.sh"
        )
    return python


def build_model(directory: Path, **shape: int | str) -> Path:
    require_engine()
    args = [str(ENGINE_PYTHON), str(ENGINE_KIT), "model", str(directory)]
    for name, value in shape.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    subprocess.run(args, check=True, env=engine_env(), capture_output=True, timeout=300)
    return directory


def run_engine(
    plan: dict[str, Any],
    work: Path,
    name: str,
    timeout: float = 1200,
    killed: bool = False,
    on_host: Sequence[str] = (),
) -> dict[str, Any]:
    """Run one engine process on ``plan`` (in a process group of its own); its results (the
    log is kept beside them). ``killed``: the plan ends by SIGKILLing its group.
    ``on_host``: a command prefix that runs it elsewhere (a network namespace)."""
    require_engine()
    work.mkdir(parents=True, exist_ok=True)
    plan_file, out_file, log_file = (
        work / f"{name}.{ext}" for ext in ("plan.json", "out.json", "log")
    )
    plan_file.write_text(json.dumps(plan))
    with open(log_file, "wb") as log:
        proc = subprocess.run(
            [*on_host, str(ENGINE_PYTHON), str(ENGINE_KIT), "run", str(plan_file), str(out_file)],
            # the weights' fingerprints are cached beside the test's files, not in ~/.cache
            env={
                **engine_env(),
                "XDG_CACHE_HOME": str(work / "cache"),
                # the engine core, its scheduler and its worker in this process: the worker
                # beside the scheduler as on one GPU (``uni``, which the CPU build keeps only
                # this way), and two processes fewer to start (each imports torch anew)
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
    if proc.returncode != (-9 if killed else 0):
        tail = log_file.read_text(errors="replace")[-4000:]
        raise AssertionError(f"engine {name} exited {proc.returncode}:\n{tail}")
    return json.loads(out_file.read_text())


class Tiering:
    """One process of ``benchmarks/vllm_tiering.py`` (vLLM's tiered offloading on the CPU)
    running a plan, started at once; :meth:`result` waits for it."""

    def __init__(
        self,
        plan: dict[str, Any],
        work: Path,
        name: str,
        version: str = "0.32",
        on_host: Sequence[str] = (),
    ):
        """``on_host``: a command prefix that runs the process elsewhere (a network
        namespace's ``ip netns exec ...``)."""
        python = require_engine(version)
        work.mkdir(parents=True, exist_ok=True)
        plan = {"engine_id": f"{name}-{os.getpid()}-{work.name}", **plan}
        self.name = name
        plan_file, self.out_file, self.log_file = (
            work / f"{name}.{ext}" for ext in ("plan.json", "out.json", "log")
        )
        plan_file.write_text(json.dumps(plan))
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                [*on_host, str(python), str(TIERING_KIT), str(plan_file), str(self.out_file)],
                env=engine_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def result(self, timeout: float = 600) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            raise AssertionError(f"{self.name} did not finish:\n{self._tail()}") from None
        if code != 0:
            raise AssertionError(f"{self.name} exited {code}:\n{self._tail()}")
        return json.loads(self.out_file.read_text())

    def failure(self, timeout: float = 600) -> str:
        """The log of a process expected to fail (AssertionError if it succeeded)."""
        code = self.proc.wait(timeout=timeout)
        if code == 0:
            raise AssertionError(f"{self.name} succeeded; it was expected to fail")
        return self.log_file.read_text(errors="replace")

    def _tail(self) -> str:
        return self.log_file.read_text(errors="replace")[-4000:]


def step(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in result["steps"] if s.get("name") == name)


def scraped(result: dict[str, Any], index: int = 0) -> dict[str, float]:
    """The ``persisting_vllm_*`` samples of the ``index``-th scrape step."""
    texts = [s["text"] for s in result["steps"] if s.get("action") == "scrape"]
    samples: dict[str, float] = {}
    for line in texts[index].splitlines():
        if line.startswith("persisting_vllm_"):
            name, _, value = line.rpartition(" ")
            samples[name.split("{")[0]] = samples.get(name.split("{")[0], 0.0) + float(value)
    return samples


def stored_parents(root: Path) -> dict[str, str | None]:
    """Each stored block's parent as its payload file's header says (block hashes, hex)."""
    from persisting.kv.disk.payload_files import HEADER_BYTES, FileHeader

    out: dict[str, str | None] = {}
    for path in root.rglob("*.kv"):
        with open(path, "rb") as f:
            header = FileHeader.decode(f.read(HEADER_BYTES), None)
        parent = header.parent.split("@")[3] if header.parent else None
        out[header.key.split("@")[3]] = parent
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def persisting_cli(*args: str) -> str:
    """The ``persisting`` command of the test environment, run on this checkout."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "persisting.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return proc.stdout
