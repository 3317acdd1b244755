"""Which values of a batch larger than the disk budget to store: each chain's head.

A prompt longer than the budget, put as one batch, used to fail whole and leave nothing to
reuse; a prefix still hits, so the budget keeps the batch's first chunks instead -- found
by the parents given within the batch, since a caller may list a request's chunks last
first (LMCache's adapter does, for LRU's sake).
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_first(keys: Sequence[str], parents: Sequence[str | None]) -> list[int]:
    """Indexes of the batch, each chain's prefix before its suffix (depth by the parents
    within the batch), ties in batch order."""
    at = {key: i for i, key in enumerate(keys)}
    depth: dict[int, int] = {}
    for i in range(len(keys)):
        path: list[int] = []
        j: int | None = i
        while j is not None and j not in depth and j not in path:
            path.append(j)
            parent = parents[j]
            j = at.get(parent) if parent is not None else None
        base = depth.get(j, -1) if j is not None else -1
        for k in reversed(path):
            base += 1
            depth[k] = base
    return sorted(range(len(keys)), key=lambda i: (depth[i], i))


def heads_that_fit(
    keys: Sequence[str], parents: Sequence[str | None], sizes: Sequence[int], room: int
) -> list[int]:
    """The indexes (in batch order) of the values to store in ``room`` bytes: all of them
    when they fit, else the chains' heads that do -- at least one, so a batch that cannot
    start fails as any batch does."""
    if sum(sizes) <= room:
        return list(range(len(keys)))
    kept: list[int] = []
    total = 0
    for i in prefix_first(keys, parents):
        if total + sizes[i] > room:
            break
        total += sizes[i]
        kept.append(i)
    return sorted(kept) or [prefix_first(keys, parents)[0]]


__all__ = ["heads_that_fit", "prefix_first"]
