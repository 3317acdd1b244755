"""Where values were recently placed in a store's shared pool, told to same-host readers.

A same-host client copies a memory-tier value out of the server's pool itself once it
knows where the value lies; without that it asks (one round trip on the Unix socket). A
client learns locations from its own puts and gets; this
feed lets it learn the ones *other* clients' puts created, riding on replies it already
receives: each pooled ``get`` reply ends with the placements recorded since that session's
last reply (newest first, at most :data:`TOLD_PER_REPLY`). So an engine reading a prefix
another engine on the host just stored pays one request for its first key, not one per
key. A told location is only a hint: the reader's generation check after the copy proves
it current, and a stale one makes the reader ask.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any

from persisting.kv import Layout

#: Placements kept per model (older ones are no longer told).
FEED_LENGTH = 4096
#: Placements told in one reply (newest first): bounds a reply's size and decoding.
TOLD_PER_REPLY = 512


#: One placement: sequence number, key, layout, pool offset, generation.
_Placement = tuple[int, str, Layout, int, int]


class PlacementFeed:
    """Recent pool placements per model (how far a session has been told is kept in the
    session: :attr:`~persisting.service.sessions.Session.placements_told`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._feeds: dict[str, deque[_Placement]] = {}

    def record(self, model: str, key: str, layout: Layout, offset: int, generation: int) -> None:
        with self._lock:
            feed = self._feeds.setdefault(model, deque(maxlen=FEED_LENGTH))
            feed.append((next(self._seq), key, layout, offset, generation))

    def tell(self, told: dict[str, int], model: str) -> dict[str, Any] | None:
        """Placements of ``model`` a session has not been told yet (``told``: its cursors
        by model, advanced here), as a reply part:
        ``{"layouts": [layout dicts], "told": [[key, layout index, offset, generation]]}``;
        None when there are none."""
        with self._lock:
            feed = self._feeds.get(model)
            if not feed:
                return None
            last = told.get(model, 0)
            newest = feed[-1][0]
            if newest <= last:
                return None
            told[model] = newest
            fresh: list[_Placement] = []
            for entry in reversed(feed):
                if entry[0] <= last or len(fresh) == TOLD_PER_REPLY:
                    break
                fresh.append(entry)
        layouts: dict[Layout, int] = {}
        rows = [
            [key, layouts.setdefault(layout, len(layouts)), offset, generation]
            for _seq, key, layout, offset, generation in fresh
        ]
        return {"layouts": [layout.to_dict() for layout in layouts], "told": rows}


__all__ = ["FEED_LENGTH", "TOLD_PER_REPLY", "PlacementFeed"]
