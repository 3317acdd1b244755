"""Pulsing is the ``service`` extra: everything an inference engine loads works without it.

Each check runs in a fresh interpreter where importing ``pulsing`` fails (as in an engine's
environment, where Pulsing 0.1.2's pydantic cap keeps it out), and asserts that the module
imported and that no Pulsing module was loaded behind its back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BLOCK_PULSING = """
import importlib.abc, sys
class _NoPulsing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pulsing" or name.startswith("pulsing."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoPulsing())
"""

#: What an engine imports: the KV core, both LMCache adapters, the vLLM connector's
#: engine-free modules (the rest imports vLLM, checked in the engine environment by
#: tests/engines/test_engine_install.py), the queue's Lance storage, and the CLI.
ENGINE_MODULES = [
    "persisting.kv",
    "persisting.lmcache",
    "persisting.integrations.lmcache.l2_adapter",
    "persisting.lmcache_backend",
    "persisting.integrations.common",
    "persisting.integrations.sglang.page_store",
    "persisting.integrations.vllm",
    "persisting.integrations.vllm.settings",
    "persisting.integrations.vllm.namespace",
    "persisting.integrations.vllm.blocks",
    "persisting.integrations.vllm.shared",
    "persisting.integrations.vllm.metrics",
    "persisting.integrations.vllm.events",
    "persisting.queue.backend",
    "persisting.cli",
]


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", BLOCK_PULSING + code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_engine_modules_import_no_pulsing(module: str) -> None:
    proc = _python(f"import {module}, sys; print('pulsing' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


CLI = (
    "import sys; from persisting.cli import main; sys.argv = ['persisting', *sys.argv[1:]]; main()"
)


def test_local_commands_work_without_pulsing(tmp_path: Path) -> None:
    for args in (
        ["plan", "--model", "llama-3.1-8b", "--prefix-tokens", "4096", "--json"],
        ["config", "sample"],
        ["inspect", "--storage-path", str(tmp_path / "absent")],
    ):
        proc = _python(CLI, *args)
        assert "No module named" not in proc.stderr, (args, proc.stderr)
        assert "Pulsing is not installed" not in proc.stderr, (args, proc.stderr)
        assert proc.returncode in (0, 2), (args, proc.stderr)  # 2: no root there


def test_service_commands_name_the_extra_in_one_line(tmp_path: Path) -> None:
    proc = _python(CLI, "serve", "--model", "m", "--storage-path", str(tmp_path / "root"))
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "service" in lines[0] and "Pulsing" in lines[0]


def test_an_engine_naming_a_cluster_without_the_extra_is_told_which_extra() -> None:
    """The engine adapters' opener, given a ``cluster``, says what to install (a
    ConfigError, as a bad key is), not a bare ModuleNotFoundError."""
    code = (
        "from persisting.errors import ConfigError\n"
        "from persisting.integrations.common import EngineSettings, open_engine_store\n"
        "s = EngineSettings.model_validate({'cluster': {'seeds': ['127.0.0.1:9']}})\n"
        "try:\n"
        "    open_engine_store(s, 'ns')\n"
        "except ConfigError as exc:\n"
        "    print('ConfigError', exc)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "ConfigError" in proc.stdout and "persisting[service]" in proc.stdout, proc.stdout
