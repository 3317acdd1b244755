"""One disk budget for a whole storage root, however many namespaces it holds.

A namespace is opened per model, per weights version and, for engines, per KV layout: a
changed dtype or block size opens a new one and leaves the old one on disk. Were each
bounded only by its own ``disk_bytes``, a root would grow to N times what the operator
set. So a writer keeps its namespace within its ``disk_bytes`` *less what the root's other
namespaces hold*, read from their usage counters:

- namespaces no live store holds (idle: an old layout, a model not served now) give way
  first: the one opened longest ago is dropped whole, then the next, until the root fits;
- live namespaces never evict each other: a writer evicts its own chunks to fit in what
  the others leave (so the first to fill keeps its room);
- writers of different namespaces may each add one batch at the same moment, so the root
  may go over by that much before the next reservation brings it back.

The other namespaces' totals are read at most every :data:`REFRESH_S` seconds: a write
path must not list the root for every batch.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from persisting.errors import NamespaceInUseError, PersistingError
from persisting.kv.namespace_record import read_record
from persisting.lance_store import StorageRoot, disk_usage

log = logging.getLogger(__name__)

#: Seconds the other namespaces' totals are reused before they are read again.
REFRESH_S = 1.0
#: The usage counter of a namespace (see :mod:`persisting.kv.shared_usage`): three int64
#: slots, payload, overhead and metadata reservations.
_COUNTER = "usage.bin"
_SLOTS = struct.Struct("<qqq")


@dataclass(frozen=True, slots=True)
class Neighbour:
    """Another namespace of the root: its name, bytes held and when it was last opened."""

    name: str
    bytes: int
    opened_at: float


class RootUsage:
    """What the root's namespaces other than ``own`` hold, and dropping idle ones."""

    def __init__(self, root: StorageRoot, own: str, clock: Callable[[], float] = time.monotonic):
        self.root = root
        self.own = own
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._others: list[Neighbour] = []
        #: Idle namespaces this writer dropped to keep the root within its budget.
        self.dropped = 0

    def others_bytes(self, *, fresh: bool = False) -> int:
        """Bytes the other namespaces hold (read at most every REFRESH_S unless ``fresh``)."""
        return sum(n.bytes for n in self._neighbours(fresh))

    def forget(self) -> None:
        """Read the other namespaces afresh at the next reservation (a reservation made while
        opening must not stand for the root as it is once writing starts)."""
        with self._lock:
            self._read_at = None

    def _neighbours(self, fresh: bool) -> list[Neighbour]:
        with self._lock:
            now = self._clock()
            if fresh or self._read_at is None or now - self._read_at >= REFRESH_S:
                self._others = [n for n in map(self._read, self._names()) if n is not None]
                self._read_at = now
            return list(self._others)

    def _names(self) -> list[str]:
        return [name for name in self.root.list_models() if name != self.own]

    def _read(self, name: str) -> Neighbour | None:
        directory = self.root.kv_path(name)
        try:
            raw = (directory / _COUNTER).read_bytes()
            held = sum(max(0, v) for v in _SLOTS.unpack(raw)) if len(raw) == _SLOTS.size else 0
        except FileNotFoundError:
            if not directory.is_dir():
                return None
            held = disk_usage(directory)  # not a store's namespace layout: count its files
        except OSError:
            return None
        record = read_record(directory)
        return Neighbour(name, held, record.opened_at if record else _mtime(directory))

    def drop_idle(self, need: int) -> int:
        """Drop whole namespaces no live store holds, the one opened longest ago first,
        until ``need`` bytes are freed or none is left; returns the bytes freed."""
        freed = 0
        for neighbour in sorted(self._neighbours(fresh=True), key=lambda n: n.opened_at):
            if freed >= need:
                break
            try:
                dropped = self.root.drop_model(neighbour.name)
            except NamespaceInUseError:
                continue  # live: never taken from
            except PersistingError as exc:
                log.warning("cannot drop idle namespace %s: %s", neighbour.name, exc)
                continue
            if dropped:
                freed += neighbour.bytes
                self.dropped += 1
                log.warning(
                    "dropped idle namespace %r (%d bytes, last opened %s) to keep %s within"
                    " its disk budget",
                    neighbour.name,
                    neighbour.bytes,
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(neighbour.opened_at)),
                    self.root.root,
                )
        if freed:
            self._neighbours(fresh=True)
        return freed


def _mtime(path: os.PathLike[str]) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


__all__ = ["REFRESH_S", "Neighbour", "RootUsage"]
