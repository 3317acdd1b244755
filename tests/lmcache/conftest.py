"""Fixtures of the LMCache plugin tests (real LMCache 0.5.6, real storage on disk).

Without LMCache installed (``PERSISTING_SKIP_LMCACHE=1``) this directory is skipped, and
under CI a skip is a failure.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # before lmcache is imported

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (PERSISTING_SKIP_LMCACHE=1?)")
from lmcache.v1.storage_backend.storage_manager import StorageManager

from tests.lmcache.lmcache_harness import make_config, storage_manager


@pytest.fixture
def manager(root: Path) -> Iterator[StorageManager]:
    """A StorageManager with LocalCPUBackend and the plugin, loaded from config."""
    with storage_manager(make_config(root)) as m:
        yield m


@pytest.fixture(autouse=True)
def no_leaked_references(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test that drops a MemoryObj while still holding a reference to it.

    LMCache only logs this (when the object is garbage collected); it would otherwise hide
    a reference the plugin forgot to release.
    """
    yield
    gc.collect()
    records = [*caplog.get_records("setup"), *caplog.get_records("call"), *caplog.records]
    leaks = [
        r.getMessage() for r in records if "garbage collected with ref_count" in r.getMessage()
    ]
    assert not leaks, leaks
