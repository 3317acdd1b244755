"""The layers hold: every module of ``persisting`` and of the top-level ``actors`` package
imports, no module imports a layer above its own, and no modules import each other in a
circle.

The rule (docs/architecture.md): cli -> actors -> service -> kv -> lance_store; queue ->
lance_store; the engine adapters (integrations) -> service -> kv; errors, config, shm and
cuda sit under everything.
``actors`` is a package of its own beside ``persisting`` (the design card's top level): its
modules form the ``actors`` group, and only the command line may import it.
Imports are read from the source (``ast``), so a lazy import inside a function counts as
much as one at the top of a module.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The packages the project installs (pyproject's packages.find).
PACKAGES = ("persisting", "actors")

_BOTTOM = {"errors", "config", "shm", "cuda"}
_STORAGE = _BOTTOM | {"lance_store"}
_DATA = _STORAGE | {"kv", "queue"}

#: What each top-level group of ``persisting`` (and the ``actors`` package) may import
#: (besides itself and the bare ``persisting`` package, which only carries ``__version__``).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "shm": {"errors", "config"},
    "cuda": {"errors", "config", "shm"},
    "lance_store": {"errors", "config", "shm"},
    "kv": _STORAGE,
    # Where Persisting works around Pulsing's behaviour (imports no Pulsing at the top).
    "pulsing_compat": set(),
    "queue": _STORAGE | {"pulsing_compat"},
    "figures": _DATA,
    "metrics": _DATA | {"figures"},
    "planner": {"errors", "config"},
    "service": _STORAGE | {"kv", "pulsing_compat"},
    # The LMCache adapters' documented import paths, re-exporting integrations.lmcache.
    "lmcache": {"integrations"},
    "lmcache_backend": {"integrations"},
    # The vLLM connector follows prewarm/evict events on a queue topic of its root; the
    # engine adapters' opener reaches a cluster through the service's client.
    "integrations": _BOTTOM | {"kv", "queue", "service", "pulsing_compat"},
    "admin": _DATA | {"figures", "metrics"},
    "bench": _DATA | {"planner", "service"},
    "actors": _DATA | {"service", "figures", "metrics", "pulsing_compat"},
    # The command line may import all (docs/architecture.md); `prewarm --hash-scheme
    # lmcache-mp` hashes token ids with the LMCache package's object keys.
    "cli": _DATA
    | {"service", "actors", "admin", "bench", "planner", "figures", "metrics"}
    | {"pulsing_compat"}
    | {"integrations"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _group(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "actors":
        return "actors"
    return parts[1] if len(parts) > 1 else ""


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, top_level_only: bool) -> set[str]:
    """The ``persisting`` and ``actors`` modules ``module`` imports (a name imported from a
    package counts as its submodule when there is one)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    if top_level_only:  # what runs when the module is imported, not in functions
        nodes: list[ast.AST] = []
        pending: list[ast.AST] = list(tree.body)
        while pending:
            node = pending.pop()
            nodes.append(node)
            if isinstance(node, ast.If) and not _is_type_checking(node):
                pending += node.body + node.orelse
            elif isinstance(node, ast.Try):
                pending += node.body + node.orelse + node.finalbody
                pending += [s for h in node.handlers for s in h.body]
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {target}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _imports_engine(module: str, engine: str) -> bool:
    tree = ast.parse(MODULES[module].read_text())
    return any(
        (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == engine)
        or (isinstance(n, ast.Import) and any(a.name.split(".")[0] == engine for a in n.names))
        for n in tree.body
    )


#: Modules that import vLLM at the top: they import in the engine environment
#: (tests/engines/test_engine_install.py imports each there), not in this one.
ENGINE_ONLY = sorted(m for m in MODULES if _imports_engine(m, "vllm"))
#: Modules that import SGLang at the top: they import in the SGLang environment
#: (tests/sglang/test_sglang_install.py imports each there), not in this one.
SGLANG_ONLY = sorted(m for m in MODULES if _imports_engine(m, "sglang"))


def test_every_module_imports() -> None:
    for module in MODULES:
        if not module.endswith(".__main__") and module not in {*ENGINE_ONLY, *SGLANG_ONLY}:
            importlib.import_module(module)  # __main__ runs the command line


def test_only_the_vllm_integration_imports_vllm() -> None:
    assert ENGINE_ONLY
    assert all(m.startswith("persisting.integrations.vllm.") for m in ENGINE_ONLY), ENGINE_ONLY


def test_only_the_sglang_integration_imports_sglang() -> None:
    assert SGLANG_ONLY
    assert all(m.startswith("persisting.integrations.sglang.") for m in SGLANG_ONLY), SGLANG_ONLY


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_layer_above_its_own(module: str) -> None:
    group = _group(module)
    if not group:
        return
    allowed = ALLOWED[group] | {group, ""}
    upward = sorted(m for m in _imports(module, top_level_only=False) if _group(m) not in allowed)
    assert not upward, f"{module} ({group}) may import only {sorted(ALLOWED[group])}: {upward}"


def test_every_group_has_a_rule() -> None:
    assert {_group(m) for m in MODULES} - {""} <= ALLOWED.keys()


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components over the imports that run at import time
    (a submodule importing its own package's half-built ``__init__`` is not counted)."""
    graph = {m: _imports(m, top_level_only=True) - {m} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in MODULES:
                continue
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not cycles, f"modules importing each other in a circle: {cycles}"


#: Sizes a reader takes in at once: a module a sitting, a function a screen or so. The CLI's
#: commands are exempt (each is one long list of options and one call).
MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(p for pkg in ("persisting", "actors") for p in (REPO / pkg).rglob("*.py"))


def test_no_module_is_over_its_size() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_outside_the_cli_is_over_its_size() -> None:
    long = {}
    for path in _sources():
        if "cli" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
