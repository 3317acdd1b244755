"""Fixtures for the queue tests: real backends on real Lance datasets, closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from persisting.queue import LanceBackend


@pytest.fixture
def bucket_dir(tmp_path: Path) -> Path:
    """Where Pulsing would put bucket 0 of a topic: ``<root>/queue/<topic>/bucket_0``."""
    return tmp_path / "root" / "queue" / "events" / "bucket_0"


@pytest.fixture
def open_backend(bucket_dir: Path) -> Iterator[Callable[..., LanceBackend]]:
    """A factory of backends on ``bucket_dir`` (or another path); all are closed afterwards."""
    opened: list[LanceBackend] = []

    def factory(path: Path | None = None, **options: Any) -> LanceBackend:
        options.setdefault("batch_size", 1_000_000)
        options.setdefault("flush_interval_s", 0)
        backend = LanceBackend(bucket_id=0, storage_path=path or bucket_dir, **options)
        opened.append(backend)
        return backend

    yield factory
    for backend in reversed(opened):
        if not backend.closed:
            backend.close()
