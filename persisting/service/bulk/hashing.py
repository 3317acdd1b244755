"""Checksums of large payloads made on a helper thread, without holding the GIL.

A client's put hashes every payload it sends, and the server compares that checksum with
its own hash of what landed. On the event loop's thread the hash (0.5 ms per 8 MiB on the
2-core machine) adds to the time the loop spends copying the payload into the socket, and
that copy sets the pace of a remote put. python-xxhash holds the GIL while it hashes; the
C function of the same library, reached through ctypes (which releases the GIL for the
call), lets a helper thread hash a payload on another core while the loop sends it. The
checksum is the same xxh3-64 either way; where the C function cannot be reached (or gives
another answer on a probe) the hash falls back to the binding.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import xxhash

#: Payloads from this size are hashed on a helper thread; a smaller one's hash costs less
#: than handing it over.
BESIDE_MIN_BYTES = 1 << 20


def _released_xxh3() -> Callable[[int, int], int] | None:
    """``XXH3_64bits_dispatch`` of python-xxhash's extension (the variant for this CPU,
    as the binding uses), if it is exported and agrees with the binding on a probe."""
    try:
        extension = importlib.import_module("xxhash._xxhash")
        function = ctypes.CDLL(str(extension.__file__)).XXH3_64bits_dispatch
    except (ImportError, OSError, AttributeError, TypeError):
        return None
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    raw = bytes(range(256)) * 129
    probe = np.frombuffer(raw, dtype=np.uint8)
    if function(probe.ctypes.data, probe.nbytes) != xxhash.xxh3_64_intdigest(raw):
        return None
    released: Callable[[int, int], int] = function
    return released


_XXH3 = _released_xxh3()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def releases_gil() -> bool:
    """Whether :func:`checksum` runs without the GIL (the C function was found)."""
    return _XXH3 is not None


def checksum(view: memoryview) -> int:
    """The xxh3-64 of ``view`` (the payload checksum), without the GIL where possible."""
    if _XXH3 is None:
        return int(xxhash.xxh3_64_intdigest(view))
    array = np.frombuffer(view, dtype=np.uint8)  # keeps ``view`` alive for the call
    return int(_XXH3(array.ctypes.data, array.nbytes))


def checksum_beside(view: memoryview) -> Future[int]:
    """Start hashing ``view`` on a helper thread; its checksum when the future is done."""
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = max(1, min(4, (os.cpu_count() or 2) - 1))
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="kv-bulk-hash")
        pool = _pool
    return pool.submit(checksum, view)


async def result(future: Future[int]) -> int:
    """The checksum of a :func:`checksum_beside` (at once when it is already made, as it
    usually is by the time the payload went out)."""
    if future.done():
        return future.result()
    return await asyncio.wrap_future(future)


__all__ = ["BESIDE_MIN_BYTES", "checksum", "checksum_beside", "releases_gil", "result"]
