"""Bookkeeping behind Pulsing's optional tensor-native backend methods.

``put_tensor`` / ``get_data`` / ``get_meta`` address records by *global index*; here that is
the record's offset. ``get_meta`` hands out offsets a task has not consumed yet; like the
bucket actor's own fallback, consumption is tracked in memory per task (a restart forgets
it; durable progress is what committed consumer positions are for).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PutResult:
    """What ``put_tensor`` stored: the shape Pulsing's bucket actor inspects."""

    global_indexes: list[int]
    field_names: list[str]

    @property
    def size(self) -> int:
        return len(self.global_indexes)


class ConsumptionTracker:
    """Per task: a cursor below which everything was consumed, and consumed offsets above."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[str, tuple[int, set[int]]] = {}

    def take(
        self,
        task: str,
        batch_size: int,
        earliest: int,
        end: int,
        sampler: Any = None,
        **sampling_kwargs: Any,
    ) -> list[int]:
        """Up to ``batch_size`` unconsumed offsets in [earliest, end), marked consumed.

        With a Pulsing ``sampler`` every unconsumed offset is offered to it and what it
        marks is consumed.
        """
        with self._lock:
            cursor, consumed = self._tasks.get(task, (earliest, set()))
            cursor = max(cursor, earliest)
            while cursor in consumed:
                consumed.discard(cursor)
                cursor += 1
            if sampler is None:
                chosen: list[int] = []
                index = cursor
                while index < end and len(chosen) < batch_size:
                    if index not in consumed:
                        chosen.append(index)
                    index += 1
                marked: list[int] = chosen
            else:
                ready = [i for i in range(cursor, end) if i not in consumed]
                chosen, marked = sampler.sample(ready, batch_size, **sampling_kwargs)
            consumed.update(marked)
            self._tasks[task] = (cursor, consumed)
            return list(chosen)

    def mark(self, task: str, offsets: list[int]) -> None:
        with self._lock:
            cursor, consumed = self._tasks.get(task, (0, set()))
            consumed.update(int(i) for i in offsets)
            self._tasks[task] = (cursor, consumed)

    def reset(self, task: str) -> None:
        with self._lock:
            self._tasks.pop(task, None)


def batch_meta(offsets: list[int], fields: list[str], partition: str) -> dict[str, Any]:
    """``get_meta``'s answer in the shape Pulsing's memory backend gives."""
    return {
        "samples": [
            {
                "partition_id": partition,
                "global_index": index,
                "fields": {
                    name: {"name": name, "dtype": None, "shape": None, "production_status": "ready"}
                    for name in fields
                },
            }
            for index in offsets
        ],
        "global_indexes": list(offsets),
    }


def global_indexes(batch_meta: Any) -> list[int]:
    """The offsets a ``get_data`` batch meta (dict or object) asks for."""
    if isinstance(batch_meta, dict):
        indexes = batch_meta.get("global_indexes") or [
            sample.get("global_index", -1) for sample in batch_meta.get("samples", [])
        ]
    else:
        indexes = getattr(batch_meta, "global_indexes", [])
    return [int(i) for i in indexes]


def contiguous_runs(indexes: list[int]) -> list[tuple[int, int]]:
    """Distinct ints as sorted half-open runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for index in sorted(set(indexes)):
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


__all__ = ["ConsumptionTracker", "PutResult", "batch_meta", "contiguous_runs", "global_indexes"]
