"""Placing keys on storage nodes: rendezvous hashing over the members that are alive.

Each key goes to the member with the highest ``xxh3_64(member || key)`` (highest random
weight). When a member leaves, only its own keys move (to their second choice, where they
are misses until recomputed and stored again); every other key stays where it was. Members
are named by their stable address, so a node that restarts on the same address gets its
keys, still on its disk, back.

:class:`Membership` tracks which members are usable: a member that failed a request is
left out until a probe reaches it again. It is pure bookkeeping (no Pulsing), so
placement and failover are testable without a cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import xxhash


def _weight(member: str, key: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{member}\0{key}".encode())


def rank_members(key: str, members: Iterable[str]) -> list[str]:
    """``members`` ordered by preference for ``key`` (first is the owner)."""
    return sorted(members, key=lambda m: (_weight(m, key), m), reverse=True)


def owner(key: str, members: Sequence[str]) -> str | None:
    """The member that owns ``key``; None when there are no members."""
    if not members:
        return None
    return max(members, key=lambda m: (_weight(m, key), m))


def group_by_owner(keys: Sequence[str], members: Sequence[str]) -> dict[str, list[int]]:
    """Indices of ``keys`` grouped by their owner (keys are left out when no member lives)."""
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        member = owner(key, members)
        if member is not None:
            groups.setdefault(member, []).append(index)
    return groups


class Membership:
    """Which storage members exist and which of them are currently usable.

    A member that failed a request is left out of placement until a probe (the client's
    keepalive, at most every ``retry_s`` seconds) reaches it again, so after the first
    failure no request waits on a dead member.
    """

    def __init__(self, retry_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.retry_s = retry_s
        self._clock = clock
        self._members: set[str] = set()
        self._next_probe: dict[str, float] = {}  # down members -> when to probe them

    def update(self, members: Iterable[str]) -> None:
        """Replace the known member set (members that vanished are forgotten)."""
        self._members = set(members)
        self._next_probe = {m: t for m, t in self._next_probe.items() if m in self._members}

    def add(self, member: str) -> None:
        self._members.add(member)

    def mark_down(self, member: str) -> None:
        """A request to ``member`` failed: leave it out until a probe succeeds."""
        self._next_probe[member] = self._clock() + self.retry_s

    def mark_up(self, member: str) -> None:
        """``member`` answered: back in use."""
        self._next_probe.pop(member, None)

    def is_live(self, member: str) -> bool:
        return member in self._members and member not in self._next_probe

    def probes_due(self) -> list[str]:
        """Down members whose next probe time has come (each is rescheduled)."""
        now = self._clock()
        due = sorted(m for m, t in self._next_probe.items() if t <= now)
        for member in due:
            self._next_probe[member] = now + self.retry_s
        return due

    @property
    def known(self) -> list[str]:
        return sorted(self._members)

    @property
    def live(self) -> list[str]:
        return sorted(m for m in self._members if self.is_live(m))


__all__ = ["Membership", "group_by_owner", "owner", "rank_members"]
