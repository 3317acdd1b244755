"""I/O errors of the LMCache plugins: counted, logged with their errno, and reported.

A failed read is a miss to LMCache (it recomputes) and a failed write fails that put; an
operator must still learn that the disk is failing. Every such error is counted and logged
once with its errno, and the last one is kept for ``stats()`` / ``report_status()``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("persisting.lmcache")  # the name it always had


def errno_of(exc: BaseException) -> int | None:
    """The errno of the OS error behind ``exc`` (following its causes), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        number = getattr(current, "errno", None)
        if isinstance(current, OSError) and isinstance(number, int):
            return number
        current = current.__cause__ or current.__context__
    return None


@dataclass(frozen=True, slots=True)
class IOErrorRecord:
    """One I/O error: what was done to which key, the errno, the message, and when."""

    op: str
    key: str
    errno: int | None
    error: str
    at: float


class IOErrors:
    """A thread-safe count of I/O errors and the most recent one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.last: IOErrorRecord | None = None

    def record(self, op: str, key: str, exc: BaseException) -> IOErrorRecord:
        number = errno_of(exc)
        entry = IOErrorRecord(op, key, number, str(exc), time.time())
        with self._lock:
            self.count += 1
            self.last = entry
        logger.warning("Persisting %s of %s failed (errno %s): %s", op, key, number, exc)
        return entry

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            last = asdict(self.last) if self.last is not None else None
            return {"io_errors": self.count, "last_io_error": last}

    def recent(self, within_s: float) -> bool:
        """Whether an I/O error happened in the last ``within_s`` seconds."""
        with self._lock:
            return self.last is not None and time.time() - self.last.at < within_s


__all__ = ["IOErrorRecord", "IOErrors", "errno_of"]
