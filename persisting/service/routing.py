"""Placing keys on storage nodes: rendezvous hashing over the members that are alive.

Each key goes to the member with the highest ``xxh3_64(member || key)`` (highest random
weight). When a member leaves, only its own keys move (to their second choice, where they
are misses until recomputed and stored again); every other key stays where it was. Members
are named by their stable address, so a node that restarts on the same address gets its
keys, still on its disk, back.

:class:`Membership` tracks which members are usable: a member that failed a request is
left out for ``retry_s`` seconds, then tried again. It is pure bookkeeping (no Pulsing), so
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
    """Which storage members exist and which of them are currently usable."""

    def __init__(self, retry_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.retry_s = retry_s
        self._clock = clock
        self._members: set[str] = set()
        self._down_until: dict[str, float] = {}

    def update(self, members: Iterable[str]) -> None:
        """Replace the known member set (members that vanished are forgotten)."""
        self._members = set(members)
        self._down_until = {m: t for m, t in self._down_until.items() if m in self._members}

    def add(self, member: str) -> None:
        self._members.add(member)

    def mark_down(self, member: str) -> None:
        """A request to ``member`` failed: leave it out until ``retry_s`` has passed."""
        self._down_until[member] = self._clock() + self.retry_s

    def mark_up(self, member: str) -> None:
        self._down_until.pop(member, None)

    def is_live(self, member: str) -> bool:
        until = self._down_until.get(member)
        return member in self._members and (until is None or until <= self._clock())

    @property
    def known(self) -> list[str]:
        return sorted(self._members)

    @property
    def live(self) -> list[str]:
        return sorted(m for m in self._members if self.is_live(m))


__all__ = ["Membership", "group_by_owner", "owner", "rank_members"]
