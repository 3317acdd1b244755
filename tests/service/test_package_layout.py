"""The design card's top level: ``actors`` is a package of its own beside ``persisting``,
and the package install carries it (pyproject's ``packages.find``), so that
``pulsing actor actors.kv_cache_storage.KVCacheStorageActor`` finds the actor wherever
Persisting is installed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from setuptools import find_packages

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def test_the_card_top_level_folders_exist() -> None:
    for folder in ("persisting", "persisting/queue", "persisting/kv", "persisting/lance_store"):
        assert (REPO / folder / "__init__.py").is_file(), folder
    for folder in ("actors", "tests", "examples", "docs"):
        assert (REPO / folder).is_dir(), folder
    assert (REPO / "actors" / "kv_cache_storage.py").is_file()
    assert not (REPO / "persisting" / "actors").exists()


def test_the_install_carries_the_actors_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(where=str(REPO), include=include))
    assert {"persisting", "persisting.kv", "actors"} <= found
    assert not {p for p in found if p.split(".")[0] not in {"persisting", "actors"}}, found
    # A data folder named like the package (the default root ./persisting-data) is no
    # package of the install (issue 40: the editable finder mapped it).
    assert not any(p.startswith("persisting-") or p.startswith("persisting_") for p in found)
    data = REPO / "persisting-data-probe"
    data.mkdir(exist_ok=True)
    try:
        (data / "__init__.py").touch()  # even one that looks like a package
        assert "persisting-data-probe" not in find_packages(where=str(REPO), include=include)
    finally:
        (data / "__init__.py").unlink()
        data.rmdir()
    assert "actors" in pyproject["tool"]["mypy"]["files"]


def test_the_actor_class_is_where_the_launcher_looks() -> None:
    from pulsing.cli.actor_loader import load_actor_class

    actor = load_actor_class("actors.kv_cache_storage.KVCacheStorageActor")
    assert actor.__module__ == "actors.kv_cache_storage"
    assert Path(importlib.import_module("actors").__file__ or "").parent == REPO / "actors"
