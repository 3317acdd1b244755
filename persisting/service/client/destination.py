"""Where the bytes of a value a client reads go.

Every read (a copy out of the server's pool, a payload file, a data connection) lands its
bytes in a :class:`Destination`: the caller's buffer for
``get_into``, else recycled private pages, as the in-process store returns values in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from persisting.errors import InvalidValueError
from persisting.kv import Layout
from persisting.kv.layout import decode_value
from persisting.shm import RecycledBuffers, aligned_buffer, copy_bytes, pages_resident, populate


class Destination:
    """Where one value's bytes go: the caller's buffer (``get_into``), else recycled private
    pages (as the in-process store returns values in: no page faults once warm, and the
    value owns them until it is dropped), else a fresh page-aligned buffer. Pages of ours
    are populated in one call before bytes land in them: a socket receive into fresh pages
    takes a fault per page inside the receive, one at a time, where one populate call maps
    them all at once."""

    def __init__(self, results: RecycledBuffers | None, nbytes: int, out: memoryview | None):
        self.out = out
        self.buffer: np.ndarray | None = None
        if out is not None:
            if len(out) != nbytes:
                raise InvalidValueError(
                    f"get_into needs a buffer of {nbytes} bytes, got {len(out)}"
                )
            self.target = out
            return
        buffer = results.take(nbytes) if results is not None else None
        if buffer is None:
            buffer = aligned_buffer(nbytes)
            populate(buffer)
        elif not pages_resident(buffer):  # recycled pages are, once used: no second walk
            populate(buffer)
        self.buffer = buffer
        self.target = buffer.data

    def value(self, layout: Layout) -> Any:
        """What the get returns once the bytes are in: the layout for ``get_into``, else
        the decoded value."""
        if self.out is not None:
            return layout
        assert self.buffer is not None
        return decode_value(layout, self.buffer)

    def discard(self) -> None:
        """The bytes are not wanted (the value moved, or failed its checksum)."""
        self.buffer = None  # its pages go back when the array is collected


def copy_into(dst: memoryview, src: memoryview) -> None:
    copy_bytes(np.frombuffer(dst, np.uint8), src)


__all__ = ["Destination", "copy_into"]
