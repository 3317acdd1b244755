"""LMCache's private state is read in one module only
(``persisting/integrations/lmcache/compat.py``, behind its release check), so an LMCache
upgrade that renames it breaks one place, and says so there."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from lmcache.v1.distributed.l2_adapters import base as l2_base
from lmcache.v1.memory_management import TensorMemoryObj

from persisting.integrations.lmcache import compat

REPO = Path(__file__).resolve().parents[2]


def _private_state(*classes: type) -> set[str]:
    """The ``self._name`` attributes LMCache's classes (and their bases) assign."""
    names: set[str] = set()
    for cls in classes:
        for klass in cls.__mro__:
            if not klass.__module__.startswith("lmcache"):
                continue
            tree = ast.parse(inspect.getsource(klass))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                ):
                    names.add(node.attr)
    return names


PRIVATE = _private_state(l2_base.L2AdapterInterface, TensorMemoryObj)


def _reads(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in PRIVATE
    } | {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in PRIVATE
    }


def test_the_private_state_is_known() -> None:
    assert {"_used_size_override", "_usage_lock", "_total_bytes_used"} <= PRIVATE


def test_only_compat_reads_lmcache_private_state() -> None:
    modules = [*(REPO / "persisting").rglob("*.py"), *(REPO / "actors").rglob("*.py")]
    found = {
        str(p.relative_to(REPO)): sorted(_reads(p))
        for p in modules
        if p.name != "compat.py" or p.parent.name != "lmcache"
    }
    assert not {k: v for k, v in found.items() if v}, found
    assert _reads(Path(compat.__file__)) & PRIVATE


def test_the_private_reads_are_behind_the_release_check() -> None:
    assert compat.LMCACHE_RELEASE == (0, 5)
    assert compat.PRIVATE_API_TESTED
