"""Every third-party package ``persisting`` and ``actors`` import is declared in
pyproject.toml (as a dependency or in an extra), lazy imports included."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]

#: The packages pyproject installs (packages.find).
FIRST_PARTY = {"persisting", "actors"}

#: Import names whose distribution is named otherwise, or is not installed in this
#: environment (the engines: vLLM lives in .venv-vllm, SGLang in .venv-sglang).
DISTRIBUTION_OF = {
    "lance": "pylance",
    "vllm": "vllm",
    "sglang": "sglang",
    "lmcache": "lmcache",
    "yaml": "pyyaml",
    "tomli": "tomli",  # Python 3.10 only
}


def imported_packages() -> set[str]:
    found: set[str] = set()
    for path in [p for pkg in FIRST_PARTY for p in (REPO / pkg).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names} - FIRST_PARTY


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return {re.split(r"[\s;<>=!~\[]", line, maxsplit=1)[0].lower() for line in lines}


def test_every_imported_package_is_declared() -> None:
    installed = metadata.packages_distributions()
    missing = {}
    for name in imported_packages():
        dists = [DISTRIBUTION_OF[name]] if name in DISTRIBUTION_OF else installed.get(name, [])
        dists = [d.lower().replace("_", "-") for d in dists]
        if not dists or not set(dists) & declared():
            missing[name] = dists
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
