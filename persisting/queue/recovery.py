"""Reading a bucket's write-ahead log back after a restart: what to replay, and whether all of
it could be.

Records a flush already stored (offsets below the dataset's end) are skipped. The log must
continue the dataset exactly: a gap means records are missing, and then nothing is replayed
and the segments are set aside for a person to look at (``wal/unreplayed/``), never deleted.
An unreadable record ends the replay there, the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from persisting.errors import CorruptValueError
from persisting.queue.codec import decode_record
from persisting.queue.wal import LogEntry, WriteAheadLog

logger = logging.getLogger(__name__)


def records_to_replay(
    wal: WriteAheadLog, stored_next: int, dataset_path: Path
) -> tuple[list[tuple[LogEntry, dict[str, Any]]], bool]:
    """The log's records from offset ``stored_next`` on, decoded, and whether that is all of
    them (False: some could not be replayed, so the log must be set aside, not deleted)."""
    entries = [e for e in wal.replay() if e.offset >= stored_next]
    if not entries:
        return [], True
    if entries[0].offset != stored_next:
        logger.error(
            "%s: the log starts at offset %d but the dataset ends at %d; not replaying",
            dataset_path,
            entries[0].offset,
            stored_next,
        )
        return [], False
    records = []
    for entry in entries:
        try:
            records.append((entry, decode_record(entry.payload)))
        except CorruptValueError:
            logger.error("%s: unreadable log record at offset %d", dataset_path, entry.offset)
            return records, False
    return records, True


def settle(wal: WriteAheadLog, replayed_all: bool, dataset_path: Path) -> None:
    """After the replayed records were flushed: delete the log, or set it aside if
    ``replayed_all`` is False."""
    if replayed_all:
        wal.drop_all_closed()
        return
    aside = wal.set_aside_closed()
    logger.error("%s: log segments that could not be replayed moved to %s", dataset_path, aside)


__all__ = ["records_to_replay", "settle"]
