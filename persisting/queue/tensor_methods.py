"""Pulsing's optional tensor-native backend methods (``put_tensor``, ``get_data``, ...).

They address records by *global index*; here that is the record's offset. Tensors need no
special path: a plain ``put`` stores them as typed columns already
(:mod:`persisting.queue.tensor_columns`), so these methods are bookkeeping around ``put`` and
``get``. ``get_meta`` hands out offsets a task has not consumed yet; like the bucket actor's
own fallback, consumption is tracked in memory per task (a restart forgets it; durable
progress is what committed consumer positions are for).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persisting.errors import InvalidValueError


@dataclass(frozen=True)
class TensorPutResult:
    """What ``put_tensor`` stored: the offsets and field names Pulsing's bucket actor inspects
    (not the KV store's ``persisting.kv.PutResult``)."""

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


def meta_of(offsets: list[int], fields: list[str], partition: str) -> dict[str, Any]:
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


def offsets_asked(batch_meta: Any) -> list[int]:
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


class TensorMethods:
    """The tensor-native methods of a backend whose records are addressed by offset.

    The backend provides ``_put`` (store records, return the first offset), ``get``,
    ``earliest_offset`` and ``_visible_next`` (the offset after the last readable record).
    """

    _consumption: ConsumptionTracker

    if TYPE_CHECKING:

        async def _put(self, records: Sequence[Any]) -> int: ...

        async def get(self, limit: int, offset: int) -> list[dict[str, Any]]: ...

        def earliest_offset(self) -> int: ...

        def _visible_next(self) -> int: ...

    async def put_tensor(self, data: Any, **kwargs: Any) -> TensorPutResult:
        """Store a record (or list of records) holding tensors; returns their offsets.

        Tensors are stored as typed ``{kind, dtype, shape, data}`` columns, exactly, so a
        plain ``put`` does the same; Pulsing's extra arguments (``partition_id``) are ignored.
        """
        if isinstance(data, dict):
            records = [data]
        elif isinstance(data, list) and all(isinstance(r, dict) for r in data):
            records = data
        else:
            raise InvalidValueError("put_tensor expects a dict or a list of dicts")
        if not records:
            return TensorPutResult([], [])
        first = await self._put(records)
        names = sorted({k for r in records for k in r if not str(k).startswith("_")})
        return TensorPutResult(list(range(first, first + len(records))), names)

    async def get_data(self, batch_meta: Any, fields: list[str] | None = None) -> Any:
        """The records at ``batch_meta``'s ``global_indexes`` (offsets), optionally projected."""
        earliest, end = self.earliest_offset(), self._visible_next()
        wanted = [i for i in offsets_asked(batch_meta) if earliest <= i < end]
        by_offset: dict[int, dict[str, Any]] = {}
        for start, stop in contiguous_runs(wanted):
            for index, record in enumerate(await self.get(stop - start, start), start):
                by_offset[index] = record
        rows = [by_offset[i] for i in wanted if i in by_offset]
        if not fields:
            return rows
        return [{k: v for k, v in row.items() if k in fields} for row in rows]

    async def get_meta(
        self,
        fields: list[str],
        batch_size: int,
        task_name: str = "default",
        sampler: Any = None,
        **sampling_kwargs: Any,
    ) -> Any:
        """Offsets ``task_name`` has not consumed yet (tracked in memory), as Pulsing expects."""
        taken = self._consumption.take(
            task_name,
            batch_size,
            self.earliest_offset(),
            self._visible_next(),
            sampler,
            **sampling_kwargs,
        )
        partition = sampling_kwargs.get("partition_id", "default")
        return meta_of(taken, fields, partition)

    async def mark_consumed(self, task_name: str, global_indexes: list[int]) -> None:
        self._consumption.mark(task_name, global_indexes)

    async def reset_consumption(self, task_name: str) -> None:
        self._consumption.reset(task_name)


__all__ = [
    "ConsumptionTracker",
    "TensorMethods",
    "TensorPutResult",
    "contiguous_runs",
    "meta_of",
    "offsets_asked",
]
