"""Running SGLang's own storage classes (CPU) in the SGLang environment, from the tests.

The SGLang environment is ``.venv-sglang`` at the repository root (built by
``scripts/install.sh`` through ``scripts/install_sglang_env.sh``); each run is a process of
``benchmarks/sglang_kit.py`` running a JSON plan (see its docstring).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SGLANG_VENV = REPO / ".venv-sglang"
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
KIT = REPO / "benchmarks" / "sglang_kit.py"


def sglang_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG_"))}
    env["PYTHONPATH"] = str(REPO)  # this checkout's Persisting, as the editable install says
    return env


def require_sglang() -> None:
    if not SGLANG_PYTHON.exists():
        raise AssertionError(f"no SGLang environment at {SGLANG_VENV}: run bash scripts/install.sh")


def extra_config(root: Path, **more: Any) -> dict[str, Any]:
    """The documented extra config (docs/sglang.md), over ``root``."""
    return {
        "backend_name": "persisting",
        "module_path": "persisting.integrations.sglang",
        "class_name": "PersistingHiCacheStorage",
        "interface_v1": 1,
        "storage_path": str(root),
        "disk_bytes": "256MB",
        **more,
    }


def run_kit(
    plan: dict[str, Any],
    work: Path,
    name: str,
    timeout: float = 600,
    killed: bool = False,
    on_host: Sequence[str] = (),
) -> dict[str, Any]:
    """Run one kit process on ``plan`` (in a process group of its own; ``on_host``: a
    command prefix that runs it elsewhere, e.g. in a network namespace); its output."""
    require_sglang()
    work.mkdir(parents=True, exist_ok=True)
    plan_file, out_file, log_file = (
        work / f"{name}.{ext}" for ext in ("plan.json", "out.json", "log")
    )
    plan_file.write_text(json.dumps(plan))
    with open(log_file, "wb") as log:
        proc = subprocess.run(
            [*on_host, str(SGLANG_PYTHON), str(KIT), "run", str(plan_file), str(out_file)],
            env=sglang_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
    if proc.returncode != (-9 if killed else 0):
        tail = log_file.read_text(errors="replace")[-4000:]
        raise AssertionError(f"kit {name} exited {proc.returncode}:\n{tail}")
    return json.loads(out_file.read_text())


def page_keys(count: int, seed: int = 0) -> list[str]:
    """Chained SHA-256 hex digests, the shape of SGLang's page hashes (as the kit makes)."""
    keys, prior = [], hashlib.sha256(f"seed{seed}".encode()).digest()
    for i in range(count):
        prior = hashlib.sha256(prior + i.to_bytes(8, "little")).digest()
        keys.append(prior.hex())
    return keys


def du(path: Path) -> int:
    """Bytes allocated under ``path``."""
    return sum(
        os.lstat(os.path.join(d, n)).st_blocks * 512
        for d, dirs, files in os.walk(path)
        for n in [*dirs, *files]
    )
