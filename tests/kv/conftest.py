"""Every store a KV test opens in this process checks the order of its locks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from persisting.kv.lock_order import checking


@pytest.fixture(autouse=True)
def locks_taken_in_order() -> Iterator[None]:
    """Fail a test whose stores took a lock under one that comes after it in
    :mod:`persisting.kv.lock_order` (on any thread, the store's own included)."""
    with checking() as log:
        yield
    assert log.inversions == [], "locks taken against persisting.kv.lock_order"
