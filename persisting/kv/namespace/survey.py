"""A namespace's stored figures, read from its files without opening a store.

Opening a :class:`~persisting.kv.KVStore` reconciles, adopts, evicts to its budget and
commits metadata: right for a writer, wrong for a report. ``persisting stats`` and
``inspect`` read what is there through this module instead, which only lists directories
and reads ``stat`` and the namespace record: nothing is created, moved or removed, whatever
the settings of the process that asks.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from persisting.kv.budget.shared_usage import SharedUsage
from persisting.kv.disk.payload_files import round_to_block, scan_payload
from persisting.kv.namespace.record import read_record


def namespace_figures(directory: Path) -> dict[str, Any]:
    """The disk figures of namespace ``directory``, named as ``KVStore.stats()`` names
    them: chunks held, the bytes its capacity counts (payload files block-rounded plus
    the metadata and directories), that overhead alone, and the capacity its last writer
    configured (absent when no writer recorded one)."""
    items = 0
    payload = 0
    for path, _hash, _tag in scan_payload(directory):
        with contextlib.suppress(FileNotFoundError):  # evicted while we looked
            payload += round_to_block(os.stat(path).st_size)
            items += 1
    overhead = SharedUsage.measure_overhead(directory) if directory.is_dir() else 0
    figures: dict[str, Any] = {
        "disk_items": items,
        "disk_bytes": payload + overhead,
        "disk_overhead_bytes": overhead,
    }
    record = read_record(directory)
    if record is not None:
        figures["disk_capacity"] = record.capacity
    return figures


__all__ = ["namespace_figures"]
