"""The package installs only ``persisting``: no generic top-level module such as ``actors``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_actors_live_inside_the_persisting_package() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'include = ["persisting*"]' in pyproject  # packages.find (tomllib needs 3.11)
    assert not (REPO / "actors").exists()
    assert importlib.util.find_spec("actors") is None
    from persisting.actors.kv_cache_storage import KVCacheStorageActor

    assert KVCacheStorageActor.__module__ == "persisting.actors.kv_cache_storage"
