"""Hit ratios of a block trace in a pool of storage members, whole and with one lost.

A pool of ``members`` members, each an LRU cache of ``member_blocks`` blocks, places each
block as the service places a key: by :func:`persisting.service.routing.rank_members` of
its store key (:func:`persisting.bench.simulate.block_key`) over the live members. A block
has ``copies`` places, the first ``copies`` members of its ranking (1 or 2), and a read
finds it on the first of them that holds it. Three policies:

- ``one``: one copy, on the first of its ranking (``replicas = 1``).
- ``all``: two copies of every block, both written when it is stored.
- ``reused``: one copy when it is stored; on a read hit, a copy is written to each of its
  two places that lacks one (the first hit makes the second copy; a later hit remakes one
  that was evicted or lost).

Requests are taken in trace order, as :mod:`persisting.bench.simulate` takes them: the
request's **hit** is the leading run of its blocks found in the pool (prefix caching stops
at the first miss), and the token hit ratio is hit blocks over all blocks. Then every block
of the request is used in order: one found is made recent on the member it was found on
(the copy read; the other copy is not touched), one not found is stored (``all``: on both
places; otherwise on the first), each member evicting its least recently used block when
full. So ``one`` over a pool of N members of C blocks is LRU over N*C blocks split by hash.

**A member lost**: the trace is played to its middle request, then one member is lost
with its contents, and the rest is played over the survivors (a block's places are then
its first ranks among them: the rendezvous ranking less the lost member). Each member is
lost in turn from the same state at the middle, and the figures are their mean, so that no
lucky member decides.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from persisting.bench.simulate import block_key
from persisting.errors import InvalidValueError
from persisting.service.routing import rank_members

Requests = Sequence[Sequence[Hashable]]
#: The policies, in the order the tables show them.
POLICIES = ("one", "all", "reused")
#: Copies each policy places a block on.
COPIES = {"one": 1, "all": 2, "reused": 2}


def member_names(members: int) -> list[str]:
    """The pool's members, named as the service names them (stable addresses)."""
    return [f"10.0.0.{i + 1}:7000" for i in range(members)]


@dataclass
class Pool:
    """The members' LRU caches and the blocks' rankings (the state one replay carries)."""

    members: list[str]
    member_blocks: int
    policy: str
    live: list[str] = field(default_factory=list)
    caches: dict[str, OrderedDict[Hashable, None]] = field(default_factory=dict)
    #: Each block's ranking over all the members (a loss only leaves members out of it).
    rankings: dict[Hashable, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in COPIES:
            raise InvalidValueError(f"unknown pool policy {self.policy!r}; one of {POLICIES}")
        if not self.live:
            self.live = list(self.members)
        if not self.caches:
            self.caches = {m: OrderedDict() for m in self.members}

    def copy(self) -> Pool:
        """An independent pool in the same state (the rankings are shared: they do not
        change)."""
        return Pool(
            self.members,
            self.member_blocks,
            self.policy,
            list(self.live),
            {m: OrderedDict(c) for m, c in self.caches.items()},
            self.rankings,
        )

    def lose(self, member: str) -> None:
        """``member`` is gone with its contents; placement ranks the survivors."""
        self.live.remove(member)
        del self.caches[member]

    def places(self, block: Hashable) -> list[str]:
        """The live members ``block`` has a copy on, in the order reads try them."""
        ranking = self.rankings.get(block)
        if ranking is None:
            ranking = tuple(rank_members(block_key(block), self.members))
            self.rankings[block] = ranking
        copies = COPIES[self.policy]
        return [m for m in ranking if m in self.caches][:copies]

    def holder(self, block: Hashable, places: Sequence[str]) -> str | None:
        for member in places:
            if block in self.caches[member]:
                return member
        return None

    def put(self, member: str, block: Hashable) -> None:
        cache = self.caches[member]
        if block in cache:
            cache.move_to_end(block)
            return
        if len(cache) >= self.member_blocks:
            cache.popitem(last=False)
        cache[block] = None

    def request(self, blocks: Sequence[Hashable]) -> int:
        """Play one request; its hit blocks (the leading run found)."""
        placed = [self.places(block) for block in blocks]
        hits = 0
        for block, places in zip(blocks, placed, strict=True):
            if self.holder(block, places) is None:
                break
            hits += 1
        for i, (block, places) in enumerate(zip(blocks, placed, strict=True)):
            found = self.holder(block, places)
            if found is not None:
                self.caches[found].move_to_end(block)
                if self.policy == "reused" and i < hits:
                    for member in places:
                        self.put(member, block)
                continue
            for member in places if self.policy == "all" else places[:1]:
                self.put(member, block)
        return hits

    def held(self) -> tuple[int, int]:
        """``(copies, distinct blocks)`` the live members hold."""
        copies = sum(len(c) for c in self.caches.values())
        distinct = len(set().union(*(c.keys() for c in self.caches.values())))
        return copies, distinct


@dataclass(frozen=True)
class Half:
    """Hits of a stretch of the requests."""

    hit_blocks: int = 0
    blocks: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def __add__(self, other: Half) -> Half:
        return Half(self.hit_blocks + other.hit_blocks, self.blocks + other.blocks)


@dataclass(frozen=True)
class PoolRun:
    """One policy's figures: the pool whole, and the mean over the members lost in turn.

    The second half is cut in two: its first tenth of the trace's requests (``window``,
    right after the loss, where a copy matters most) and the rest."""

    policy: str
    first: Half
    whole_window: Half
    whole_rest: Half
    #: ``(window, rest)`` after each member's loss, in member order.
    lost: tuple[tuple[Half, Half], ...]
    #: ``(copies, distinct blocks)`` held at the end, the pool whole.
    held_copies: int
    held_distinct: int

    @property
    def whole(self) -> Half:
        return self.first + self.whole_window + self.whole_rest

    @property
    def whole_second(self) -> Half:
        return self.whole_window + self.whole_rest

    def lost_rates(self, part: str) -> list[float]:
        """Token hit ratios after each loss: of ``"window"``, ``"second"`` (half) or
        ``"whole"`` (the trace, the loss at its middle)."""
        halves = {
            "window": [w for w, _ in self.lost],
            "second": [w + r for w, r in self.lost],
            "whole": [self.first + w + r for w, r in self.lost],
        }[part]
        return [h.token_hit_rate for h in halves]

    def lost_mean(self, part: str) -> float:
        rates = self.lost_rates(part)
        return sum(rates) / len(rates) if rates else 0.0

    def to_dict(self) -> dict[str, object]:
        second = self.lost_rates("second")
        return {
            "policy": self.policy,
            "copies": COPIES[self.policy],
            "token_hit_rate": self.whole.token_hit_rate,
            "second_half_token_hit_rate": self.whole_second.token_hit_rate,
            "window_token_hit_rate": self.whole_window.token_hit_rate,
            "lost_token_hit_rate": self.lost_mean("whole"),
            "lost_second_half_token_hit_rate": self.lost_mean("second"),
            "lost_window_token_hit_rate": self.lost_mean("window"),
            "lost_second_half_min": min(second, default=0.0),
            "lost_second_half_max": max(second, default=0.0),
            "lost_second_half_by_member": second,
            "held_copies": self.held_copies,
            "held_distinct_blocks": self.held_distinct,
        }


def _play(pool: Pool, requests: Requests, tick: Callable[[], None] | None) -> Half:
    hits = total = 0
    for blocks in requests:
        hits += pool.request(blocks)
        total += len(blocks)
        if tick is not None:
            tick()
    return Half(hits, total)


def pool_run(
    requests: Requests,
    members: int,
    member_blocks: int,
    policy: str,
    *,
    lose: Sequence[int] | None = None,
    tick: Callable[[], None] | None = None,
) -> PoolRun:
    """``policy`` over a pool of ``members`` members of ``member_blocks`` blocks each: the
    trace whole, and its second half after losing each member in ``lose`` (indices;
    default every member) at the middle request, each from the same state."""
    if members < 2:
        raise InvalidValueError(f"a pool has at least 2 members, got {members}").about("members")
    if member_blocks < 1:
        raise InvalidValueError(f"a member holds at least 1 block, got {member_blocks}").about(
            "member_blocks"
        )
    names = member_names(members)
    lose = range(members) if lose is None else lose
    if any(not 0 <= i < members for i in lose):
        raise InvalidValueError(f"members to lose must be in 0..{members - 1}, got {list(lose)}")
    middle = len(requests) // 2
    cut = min(len(requests), middle + max(1, len(requests) // 10))
    window, rest = requests[middle:cut], requests[cut:]
    pool = Pool(names, member_blocks, policy)
    first = _play(pool, requests[:middle], tick)
    at_middle = pool.copy()
    whole_window = _play(pool, window, tick)
    whole_rest = _play(pool, rest, tick)
    copies, distinct = pool.held()
    lost: list[tuple[Half, Half]] = []
    for index in lose:
        survivor = at_middle.copy()
        survivor.lose(names[index])
        lost.append((_play(survivor, window, tick), _play(survivor, rest, tick)))
    return PoolRun(policy, first, whole_window, whole_rest, tuple(lost), copies, distinct)


__all__ = ["COPIES", "POLICIES", "Half", "Pool", "PoolRun", "member_names", "pool_run"]
