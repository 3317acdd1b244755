"""Copies of a key on more than one member: who should hold them, and what is left to send.

A key's copies belong on the first ``replicas`` live members of its rendezvous ranking
(:func:`~persisting.service.routing.rank_members`); a client writes the first of them and
reads the first live one, asking the next on a miss. Each member makes the other copies of
the keys it holds: a key becomes *wanted* (worth copies) when it is first read back, or
when it is stored under ``copy_on = "put"``; the member then asks the key's other holders
whether they have it and sends it to those that do not. When the members change (one
joins, comes back empty, or is lost) every wanted key is checked again, so a returning or
new member receives, in the background, the keys it should hold. A chunk used only once
never takes a second copy's room under ``copy_on = "read"``.

Which keys are wanted is kept in memory. A member that restarts *surveys* the keys it
holds: each is asked about on the other live members, and one that another member holds
is wanted again (only wanted keys are ever copied), so a later loss of that member is
healed from this one too. A key no other member holds is asked about again whenever the
members change (one not seen yet may hold it). A key whose other copy was lost while this
member was down as well cannot be told from one never read: it stays one copy until it is
read again.

This module is the bookkeeping, testable without a cluster: :func:`copy_targets` (where
a key's other copies go), :class:`CopyBacklog` (the wanted keys, and those still to check,
each once, oldest first, bounded), :class:`Pacer` (the stated rate).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from persisting.service.routing import rank_members

#: How long the first key due waits for others to be checked with it.
GATHER_S = 0.5
#: Wanted keys a member remembers per namespace (the oldest is forgotten first; forgetting
#: one only means a later membership change does not check its copies again).
MAX_WANTED = 1 << 20


def copy_targets(key: str, live: Sequence[str], me: str, replicas: int) -> list[str]:
    """The members other than ``me`` that should hold a copy of ``key``: the first
    ``replicas`` of its ranking over ``live`` (a key ``me`` holds but no longer ranks
    for -- written here while its owner was away -- goes to all of them)."""
    return [m for m in rank_members(key, live)[:replicas] if m != me]


class CopyBacklog:
    """The keys of each namespace worth copies, and those whose copies are still to check.

    Thread-safe: the data path adds keys from its threads, the replicator takes them.
    """

    def __init__(
        self,
        max_wanted: int = MAX_WANTED,
        gather_s: float = GATHER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_wanted = max_wanted
        self.gather_s = gather_s
        self._clock = clock
        self._lock = threading.Condition()
        self._wanted: dict[str, OrderedDict[str, None]] = {}
        #: Surveyed keys not yet known to be wanted (see the module's docstring).
        self._unsure: set[tuple[str, str]] = set()
        #: (namespace, key) -> when it became due, oldest first.
        self._due: OrderedDict[tuple[str, str], float] = OrderedDict()

    def want(self, model: str, keys: Iterable[str]) -> int:
        """``keys`` of ``model`` are worth copies: check them (those new here) soon."""
        added = 0
        with self._lock:
            wanted = self._wanted.setdefault(model, OrderedDict())
            for key in keys:
                if key in wanted:
                    continue
                wanted[key] = None
                self._unsure.discard((model, key))
                self._due[(model, key)] = self._clock()
                added += 1
            while len(wanted) > self.max_wanted:
                wanted.popitem(last=False)
            if added:
                self._lock.notify_all()
        return added

    def survey(self, model: str, keys: Iterable[str]) -> int:
        """``keys`` of ``model`` are held here, their worth unknown (this member restarted):
        each is due to be asked about (:meth:`unsure`), until :meth:`want` or
        :meth:`forget` says what it is."""
        added = 0
        with self._lock:
            wanted = self._wanted.get(model, OrderedDict())
            for key in keys:
                if key in wanted or (model, key) in self._unsure:
                    continue
                self._unsure.add((model, key))
                self._due[(model, key)] = self._clock()
                added += 1
            if added:
                self._lock.notify_all()
        return added

    def unsure(self, batch: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of ``batch`` are surveyed keys still to be judged."""
        with self._lock:
            return {pair for pair in batch if pair in self._unsure}

    def recheck(self) -> int:
        """The members changed: every wanted key is checked again, and every surveyed key
        still to be judged."""
        with self._lock:
            for model, wanted in self._wanted.items():
                for key in wanted:
                    self._due[(model, key)] = self._clock()
            for pair in self._unsure:
                self._due[pair] = self._clock()
            self._lock.notify_all()
            return len(self._due)

    def retry(self, model: str, keys: Iterable[str]) -> None:
        """Check ``keys`` again later (their copies failed to reach a live target)."""
        with self._lock:
            for key in keys:
                self._due[(model, key)] = self._clock()

    def forget(self, model: str, keys: Iterable[str]) -> None:
        """``keys`` are gone from this member (removed, evicted): nothing to copy."""
        with self._lock:
            wanted = self._wanted.get(model)
            for key in keys:
                if wanted is not None:
                    wanted.pop(key, None)
                self._due.pop((model, key), None)
                self._unsure.discard((model, key))

    def take(self, limit: int, wait_s: float) -> list[tuple[str, str]]:
        """Up to ``limit`` (namespace, key) pairs to check, oldest first, once ``limit`` are
        due or the oldest has waited ``gather_s`` (keys read together are checked and sent
        together: one question per target for the lot, not one per key); waits at most
        ``wait_s`` in all."""
        deadline = self._clock() + wait_s
        with self._lock:
            while True:
                now = self._clock()
                if self._due and len(self._due) >= limit:
                    break
                ready = next(iter(self._due.values()), None)
                until = deadline if ready is None else min(deadline, ready + self.gather_s)
                if until <= now:
                    break
                self._lock.wait(until - now)
            out: list[tuple[str, str]] = []
            while self._due and len(out) < limit:
                out.append(self._due.popitem(last=False)[0])
            return out

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    @property
    def due(self) -> int:
        with self._lock:
            return len(self._due)

    def wanted(self, model: str) -> int:
        with self._lock:
            return len(self._wanted.get(model, ()))


class Pacer:
    """Keeps what is sent at or under ``bytes_per_s`` (a token bucket one second deep)."""

    def __init__(
        self,
        bytes_per_s: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._allowance = float(bytes_per_s)
        self._at = clock()

    def delay(self, nbytes: int) -> float:
        """Take ``nbytes`` from the bucket; the seconds to wait before sending them."""
        now = self._clock()
        self._allowance = min(
            float(self.bytes_per_s), self._allowance + (now - self._at) * self.bytes_per_s
        )
        self._at = now
        self._allowance -= nbytes
        return 0.0 if self._allowance >= 0 else -self._allowance / self.bytes_per_s

    def spend(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more may be sent."""
        wait = self.delay(nbytes)
        if wait > 0:
            self._sleep(wait)


__all__ = ["GATHER_S", "MAX_WANTED", "CopyBacklog", "Pacer", "copy_targets"]
