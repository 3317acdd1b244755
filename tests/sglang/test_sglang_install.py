"""Persisting installed beside SGLang the documented way changes nothing SGLang depends on.

``.venv-sglang`` is SGLang 0.5.23 (``--no-deps``, CPU torch 2.13.0, what its storage classes
import at SGLang's own pins), with Persisting installed by ``PERSISTING_EXISTING_ENV=1
VENV=.venv-sglang bash scripts/install.sh`` (what docs/sglang.md tells SGLang's users to
run). These tests check that environment, and run that install once more to see it move
no version.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.sglang.sglang_helpers import (
    REPO,
    SGLANG_PYTHON,
    SGLANG_VENV,
    require_sglang,
    sglang_env,
)
from tests.test_architecture import SGLANG_ONLY

pytestmark = pytest.mark.slow

#: What pip check says of sglang whatever is installed beside it on a CPU-only host: the
#: requirements the recipe leaves out (CUDA kernels, serving stack), and its torch pin
#: (2.14.1; the CPU build here is 2.13.0).
LEFT_OUT = "which is not installed."
TORCH_PIN = "sglang 0.5.23 has requirement torch==2.14.1, but you have torch 2.13.0+cpu."


def _sglang(code: str) -> str:
    require_sglang()
    return subprocess.run(
        [str(SGLANG_PYTHON), "-c", code],
        env=sglang_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout


def _freeze() -> list[str]:
    out = _sglang(
        "import json; from importlib import metadata\n"
        "print(json.dumps(sorted(f\"{d.metadata['Name']}=={d.version}\""
        " for d in metadata.distributions())))"
    )
    return [line for line in json.loads(out) if not line.lower().startswith("persisting==")]


def test_pip_check_finds_no_sglang_requirement_broken() -> None:
    require_sglang()
    proc = subprocess.run(
        [str(SGLANG_PYTHON), "-m", "pip", "check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = proc.stdout.splitlines()
    about_sglang = [line for line in lines if line.lower().startswith("sglang ")]
    assert about_sglang, lines  # pip check did look at sglang
    broken = [x for x in about_sglang if not x.endswith(LEFT_OUT) and x != TORCH_PIN]
    assert broken == []
    assert [line for line in lines if "persisting" in line.lower()] == []
    # What Persisting brought in is at versions SGLang accepts (lance-namespace would take
    # python-dateutil 4.x, SGLang pins <3).
    dateutil = _sglang("from importlib import metadata; print(metadata.version('python-dateutil'))")
    assert int(dateutil.split(".")[0]) < 3


def test_the_documented_install_moves_no_version() -> None:
    before = _freeze()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    subprocess.run(
        ["bash", "scripts/install.sh"],
        cwd=REPO,
        env={**env, "PERSISTING_EXISTING_ENV": "1", "VENV": str(SGLANG_VENV)},
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert _freeze() == before


def test_the_backend_modules_import_in_sglang_without_importing_pulsing() -> None:
    """The SGLang environment has Pulsing (the ``service`` extra, for the ``cluster``
    key), but the backend's modules never import it for a local root."""
    modules = ", ".join(SGLANG_ONLY)
    out = _sglang(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
        "import sglang_kit; sglang_kit.stub_kernels()\n"
        f"import {modules}\n"
        "from persisting.integrations.sglang import PersistingHiCacheStorage\n"
        "from sglang.srt.mem_cache.hicache_storage import HiCacheStorage\n"
        "print(issubclass(PersistingHiCacheStorage, HiCacheStorage),"
        " importlib.util.find_spec('pulsing') is None, 'pulsing' in sys.modules)"
    )
    assert out.split() == ["True", "False", "False"]
