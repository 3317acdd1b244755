"""Helpers shared by the queue tests."""

from __future__ import annotations

import socket
from typing import Any


def small_records(start: int, count: int) -> list[dict[str, Any]]:
    """Small records shaped like queue events."""
    return [
        {"id": f"k{i}", "seq": i, "score": i / 4, "ok": i % 2 == 0}
        for i in range(start, start + count)
    ]


def free_port() -> int:
    """A TCP port nothing listens on right now (for a Pulsing node)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
