"""Keeping a queue dataset bounded: leveled compaction, version cleanup, retention cutoffs.

Every flush appends one small fragment and one version. Left alone, reads would visit ever
more fragments and every commit would list ever more versions (Lance finds the newest
manifest by listing them), so flushes would slow down as the bucket ages. The worker:

* compacts in levels: small fragments are merged into fragments of ``target / fanout**k``
  rows, then those into larger ones, so each row is rewritten once per level (a handful of
  times in all), never once per flush, and the newest small fragments never force a rewrite
  of the large old ones;
* deletes old versions by what readers need, not by age (:class:`VersionKeeper`), so their
  number stays small at any flush rate;
* computes where retention may trim: before a configured age, or before the slowest committed
  consumer position. Trimming deletes rows; offsets are a stored column and never move.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from persisting.lance_store import LanceTable
from persisting.lance_store.root import QUEUE_DATASET
from persisting.queue import ownership
from persisting.queue.records import OFFSET, TIMESTAMP, base_schema

#: How many fragments of one level are merged into the next.
FANOUT = 8
#: Number of levels below the target fragment size.
LEVELS = 3


@dataclass(frozen=True)
class FragmentStats:
    """What compaction planning needs to know about one fragment."""

    id: int
    rows: int
    deleted: int = 0


@dataclass(frozen=True)
class CompactionStep:
    """One compaction run: merge fragments below ``target_rows``, leave ``excluded`` alone."""

    target_rows: int
    excluded: tuple[int, ...]


def fragment_stats(dataset: Any) -> list[FragmentStats]:
    """Physical and deleted row counts of every fragment of a ``lance.LanceDataset``."""
    out = []
    for fragment in dataset.get_fragments():
        meta = fragment.metadata
        deleted = meta.deletion_file.num_deleted_rows if meta.deletion_file is not None else 0
        out.append(FragmentStats(fragment.fragment_id, meta.physical_rows, deleted))
    return out


def compaction_levels(target_rows: int, fanout: int = FANOUT, levels: int = LEVELS) -> list[int]:
    """Fragment sizes of the levels, smallest first, ending at ``target_rows``."""
    sizes = {max(1, target_rows // fanout**k) for k in range(1, levels + 1)}
    return [*sorted(sizes - {target_rows}), target_rows]


def plan_compaction(
    fragments: Sequence[FragmentStats],
    *,
    max_small: int,
    target_rows: int,
    fanout: int = FANOUT,
) -> CompactionStep | None:
    """The next compaction step, or None while at most ``max_small`` fragments are small.

    A fragment is small when it has fewer than ``target_rows`` rows or has deleted rows.
    The step merges the lowest level that has ``fanout`` fragments to merge.
    """
    small = [f for f in fragments if f.rows < target_rows or f.deleted]
    if len(small) <= max_small:
        return None
    chosen = target_rows
    for level in compaction_levels(target_rows, fanout):
        if sum(1 for f in fragments if f.rows < level or f.deleted) >= fanout:
            chosen = level
            break
    excluded = tuple(f.id for f in fragments if f.rows >= chosen and not f.deleted)
    return CompactionStep(chosen, excluded)


def compact(
    table: LanceTable,
    *,
    max_small: int,
    target_rows: int,
    max_steps: int = 4,
    on_rewrite: Callable[[int], None] | None = None,
) -> int:
    """Run compaction steps until the small fragments are few; return the steps run.

    ``on_rewrite`` is told the version each step starts from (see :class:`VersionKeeper`).
    """
    steps = 0
    while steps < max_steps:
        step = plan_compaction(
            fragment_stats(table.dataset), max_small=max_small, target_rows=target_rows
        )
        if step is None:
            break
        if on_rewrite is not None:
            on_rewrite(table.version)
        metrics = table.compact(
            target_rows_per_fragment=step.target_rows,
            excluded_fragment_ids=list(step.excluded),
        )
        steps += 1
        if not metrics.fragments_removed:
            break  # nothing mergeable (e.g. no two small fragments are adjacent)
    return steps


class VersionKeeper:
    """Which old versions of one bucket a cleanup deletes: all but a few, at any flush rate.

    A reader holds one version's manifest in memory and needs only the data files it lists.
    Appends leave every file in place, so a version followed only by appends can go at
    once: the newest version lists all of its files. A rewrite (a compaction step, a trim)
    replaces files; the version it started from lists every file a reader of that version
    or an earlier one (back to the previous rewrite) may still need, so that one version is
    kept ``retention_s`` after the rewrite, and deleting it then deletes those files. The
    versions that existed before this writer opened are kept ``retention_s`` as they are
    (what rewrote them is not known). Deleting by age alone kept every version of the last
    ``retention_s``: hundreds at a high flush rate, each making every commit slower.
    """

    def __init__(self, retention_s: float, lowest: int, latest: int, now: float):
        self.retention_s = retention_s
        # Versions lowest..latest-1 existed at open: kept as they are until this time.
        self._history: tuple[int, int, float] | None = (
            (lowest, latest, now + retention_s) if lowest < latest else None
        )
        self._low = latest  # no version of this writer's below this one exists any more
        self._kept: dict[int, float] = {}  # version a rewrite started from -> kept until
        self._planned: tuple[int, bool] | None = None

    def rewrote(self, from_version: int, now: float) -> None:
        """A rewrite committed over ``from_version``: keep that version ``retention_s``."""
        self._kept[from_version] = now + self.retention_s

    def doomed(self, latest: int, now: float) -> list[int]:
        """The versions below ``latest`` a cleanup may delete now (the newest always stays).
        Call :meth:`cleaned` once they are deleted."""
        self._kept = {v: until for v, until in self._kept.items() if until > now}
        out: list[int] = []
        history_done = self._history is not None and now >= self._history[2]
        if history_done and self._history is not None:
            out.extend(range(self._history[0], self._history[1]))
        out.extend(v for v in range(self._low, latest) if v not in self._kept)
        self._planned = (min([*self._kept, latest]), history_done)
        return out

    def cleaned(self) -> None:
        """The versions the last :meth:`doomed` named are gone."""
        if self._planned is None:
            return
        self._low, history_done = self._planned
        if history_done:
            self._history = None
        self._planned = None


def cleanup_versions(table: LanceTable, older_than_s: float) -> int:
    """Delete versions older than ``older_than_s`` seconds (the newest is always kept)."""
    return table.cleanup(timedelta(seconds=older_than_s), keep_versions=1)


def lowest_version(table: LanceTable) -> int:
    """The oldest version of ``table`` still stored."""
    return min(int(v["version"]) for v in table.dataset.versions())


def compact_bucket(
    bucket_dir: str | os.PathLike[str],
    *,
    target_rows: int = 1 << 20,
    max_small: int = 8,
    older_than_s: float = 10.0,
    lock_timeout_s: float = 0.0,
) -> int:
    """Compact one queue bucket from outside its writer (an operator's ``compact``).

    Runs under the bucket's writer lock: a compaction committed over a live writer's appends
    would put the merged fragments after them, out of offset order (the backend still reads
    such a bucket correctly, by filter, but slower). Raises StorageIOError while a writer
    holds the bucket: a live writer compacts its bucket itself. Rows found out of offset
    order are rewritten in order. Returns the compaction steps run.
    """
    bucket = Path(bucket_dir)
    fd = ownership.acquire_writer_lock(bucket, lock_timeout_s)
    try:
        table = LanceTable(bucket / QUEUE_DATASET, base_schema())
        offsets = table.dataset.to_table(columns=[OFFSET]).column(OFFSET).to_numpy()
        steps = 0
        if len(offsets) and not bool(np.all(offsets[1:] > offsets[:-1])):
            _rewrite_in_order(table)
            steps += 1
        steps += compact(table, max_small=max_small, target_rows=target_rows)
        cleanup_versions(table, older_than_s)
        return steps
    finally:
        ownership.release_writer_lock(fd)


def _rewrite_in_order(table: LanceTable) -> None:
    table.overwrite(table.dataset.to_table().sort_by(OFFSET), durable=True)


def age_cutoff(dataset: Any, first_offset: int, retention_s: float, now_us: int) -> int:
    """The first offset retention by age keeps (``_ts`` never decreases with the offset)."""
    cut = now_us - int(retention_s * 1_000_000)
    expired = dataset.count_rows(filter=f"{TIMESTAMP} < to_timestamp_micros({cut})")
    return first_offset + expired


def consumer_cutoff(positions: Mapping[str, int]) -> int | None:
    """The first offset some committed consumer still needs (None without consumers)."""
    return min(positions.values()) if positions else None


def retention_cutoff(
    dataset: Any,
    first_offset: int,
    *,
    retention_s: float | None,
    consumer_positions: Mapping[str, int] | None,
    now_us: int,
) -> int | None:
    """Where retention may trim: the larger of the age and consumer cutoffs (either policy
    lets a record go), or None when neither applies."""
    cutoffs = []
    if retention_s:
        cutoffs.append(age_cutoff(dataset, first_offset, retention_s, now_us))
    if consumer_positions:
        slowest = consumer_cutoff(consumer_positions)
        if slowest is not None:
            cutoffs.append(slowest)
    return max(cutoffs) if cutoffs else None


__all__ = [
    "FANOUT",
    "CompactionStep",
    "FragmentStats",
    "VersionKeeper",
    "age_cutoff",
    "cleanup_versions",
    "compact",
    "compact_bucket",
    "compaction_levels",
    "consumer_cutoff",
    "fragment_stats",
    "lowest_version",
    "plan_compaction",
    "retention_cutoff",
]
