"""The placement feed: what a same-host reader is told of other clients' puts."""

from __future__ import annotations

from persisting.kv import Layout
from persisting.service.handler.placements import FEED_LENGTH, TOLD_PER_REPLY, PlacementFeed


def layout(tokens: int) -> Layout:
    return Layout.from_dict(
        {"fmt": "KV_2LTD", "dtype": "bfloat16", "shape": [2, 1, tokens, 8], "nbytes": tokens * 32}
    )


def test_a_session_is_told_each_placement_once_newest_first_with_shared_layouts() -> None:
    feed = PlacementFeed()
    cursors: dict[str, int] = {}
    assert feed.tell(cursors, "m") is None  # nothing placed yet
    for i in range(3):
        feed.record("m", f"k{i}", layout(4), offset=4096 * i, generation=i + 1)
    feed.record("other-model", "x", layout(4), offset=0, generation=1)
    told = feed.tell(cursors, "m")
    assert told is not None
    assert [row[0] for row in told["told"]] == ["k2", "k1", "k0"]  # newest first
    assert len(told["layouts"]) == 1  # one layout, sent once
    _key, index, offset, generation = told["told"][0]
    assert Layout.from_dict(told["layouts"][index]) == layout(4)
    assert (offset, generation) == (8192, 3)
    assert feed.tell(cursors, "m") is None  # already told
    feed.record("m", "k3", layout(8), offset=0, generation=9)
    again = feed.tell(cursors, "m")
    assert again is not None and [row[0] for row in again["told"]] == ["k3"]
    assert feed.tell({}, "m") is not None  # another session starts from the beginning


def test_a_reply_tells_at_most_the_newest_bounded_placements() -> None:
    feed = PlacementFeed()
    for i in range(FEED_LENGTH + 10):
        feed.record("m", f"k{i}", layout(4), offset=0, generation=i)
    cursors: dict[str, int] = {}
    told = feed.tell(cursors, "m")
    assert told is not None
    assert len(told["told"]) == TOLD_PER_REPLY
    assert told["told"][0][0] == f"k{FEED_LENGTH + 9}"
    assert feed.tell(cursors, "m") is None  # the older ones are skipped, not told later
