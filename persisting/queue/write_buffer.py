"""Records put but not yet flushed into Lance, in offset order.

The rows are already admitted by the schema (column name -> value) and carry their offset
and put time; the buffer also keeps each record's encoded size, so a put can wait for a
flush once ``max_buffer_bytes`` are buffered, and when its oldest record came, so the
worker can flush by age. The backend's lock guards every call.
"""

from __future__ import annotations

import time
from typing import Any

from persisting.queue.decoding import RecordDecoder
from persisting.queue.schema import RecordSchema


class WriteBuffer:
    """Unflushed rows: appended by puts, taken from the front by flushes, which are due
    once ``batch_size`` rows wait or the oldest waited ``flush_interval_s`` (if > 0)."""

    def __init__(self, batch_size: int, flush_interval_s: float) -> None:
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self._rows: list[dict[str, Any]] = []
        self._sizes: list[int] = []
        self.bytes = 0
        #: ``time.monotonic()`` of the oldest buffered row's arrival (meaningless when empty).
        self.oldest = 0.0
        self._decoder: tuple[int, RecordDecoder] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def append(self, rows: list[dict[str, Any]], sizes: list[int]) -> None:
        if not self._rows:
            self.oldest = time.monotonic()
        self._rows.extend(rows)
        self._sizes.extend(sizes)
        self.bytes += sum(sizes)

    def head(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` rows (a copy of the list; the rows themselves are shared)."""
        return self._rows[:count]

    def rows(self, start: int, end: int) -> list[dict[str, Any]]:
        """Rows ``start..end`` counted from the first buffered one."""
        return self._rows[start:end]

    def drop_head(self, count: int) -> None:
        """Forget the first ``count`` rows (they are in Lance now)."""
        del self._rows[:count]
        self.bytes -= sum(self._sizes[:count])
        del self._sizes[:count]
        if self._rows:
            self.oldest = time.monotonic()

    def full(self) -> bool:
        """``batch_size`` rows wait: flush now."""
        return len(self._rows) >= self.batch_size

    def flush_due(self, now: float) -> bool:
        """A flush is due by size, or by the age of the oldest row at ``now``."""
        deadline = self.flush_deadline()
        return self.full() or (deadline is not None and now >= deadline)

    def flush_deadline(self) -> float | None:
        """When the oldest row's age makes a flush due (None: empty, or no flush by age)."""
        if not self._rows or self.flush_interval_s <= 0:
            return None
        return self.oldest + self.flush_interval_s

    def decoder(self, schema: RecordSchema) -> RecordDecoder:
        """A decoder of buffered rows, rebuilt when the schema widened."""
        if self._decoder is None or self._decoder[0] != schema.generation:
            self._decoder = (schema.generation, RecordDecoder(schema.fields()))
        return self._decoder[1]

    def over(self, max_records: int, max_bytes: int) -> bool:
        """True when the buffer holds too much for another put to go on without a flush."""
        return len(self._rows) >= max_records or self.bytes >= max_bytes


__all__ = ["WriteBuffer"]
