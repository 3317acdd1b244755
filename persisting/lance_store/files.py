"""Plain-file helpers every layer's fast paths share: positioned reads and writer liveness."""

from __future__ import annotations

import os

from persisting.errors import CorruptValueError, StorageIOError


def read_file_range(path: str | os.PathLike[str], offset: int, out: memoryview) -> None:
    """Fill ``out`` with exactly ``len(out)`` bytes of ``path`` from ``offset``.

    One open and positioned reads straight into the destination: no intermediate buffer.
    FileNotFoundError propagates (the file was removed, e.g. evicted: a miss to the caller);
    a file shorter than the range is a CorruptValueError; any other failure a StorageIOError.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StorageIOError(f"cannot open {path}: {exc}") from exc
    try:
        done, size = 0, len(out)
        while done < size:
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise CorruptValueError(
                    f"{path} is shorter than expected ({offset + done} < {offset + size})"
                )
            done += n
    except OSError as exc:
        raise StorageIOError(f"reading {path} failed: {exc}") from exc
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (files named after a dead writer may be cleaned up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["pid_alive", "read_file_range"]
