"""Committed consumer positions of one queue bucket, durable and readable by every process.

A position is the offset a consumer will read next. Each consumer has its own small file
(``<bucket>/consumers/<encoded name>.json``), replaced atomically (write, fsync, rename,
fsync dir), so consumers in different processes never contend and a crash leaves either the
old or the new position. Retention may trim what every committed consumer has passed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from persisting.errors import CorruptValueError, InvalidValueError, StorageIOError
from persisting.lance_store import decode_name, encode_name
from persisting.lance_store.durable import fsync_dir, fsync_fd, makedirs_durable

CONSUMERS_DIR = "consumers"


class ConsumerPositions:
    """The committed positions stored under one bucket directory."""

    def __init__(self, bucket_dir: str | os.PathLike[str]):
        self.directory = Path(bucket_dir) / CONSUMERS_DIR

    def _path(self, consumer: str) -> Path:
        return self.directory / f"{encode_name(consumer, 'consumer')}.json"

    def commit(self, consumer: str, position: int) -> None:
        """Durably record that ``consumer`` will next read ``position``."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise InvalidValueError(f"a position must be a non-negative int, got {position!r}")
        path = self._path(consumer)
        makedirs_durable(self.directory)
        body = json.dumps({"consumer": consumer, "position": position, "time": time.time()})
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, body.encode())
                fsync_fd(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise StorageIOError(f"cannot commit position of {consumer!r}: {exc}") from exc
        fsync_dir(self.directory)

    def get(self, consumer: str) -> int | None:
        """The committed position of ``consumer``, or None if it never committed."""
        return self._read(self._path(consumer))

    def all(self) -> dict[str, int]:
        """Every consumer's committed position."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            position = self._read(self.directory / name)
            if position is not None:
                out[decode_name(name[: -len(".json")])] = position
        return out

    def remove(self, consumer: str) -> bool:
        """Forget a consumer (so it no longer holds back retention); False if unknown."""
        try:
            self._path(consumer).unlink()
        except FileNotFoundError:
            return False
        fsync_dir(self.directory)
        return True

    @staticmethod
    def _read(path: Path) -> int | None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageIOError(f"cannot read {path}: {exc}") from exc
        try:
            position = json.loads(text)["position"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptValueError(f"unreadable consumer position file {path}") from exc
        if not isinstance(position, int) or position < 0:
            raise CorruptValueError(f"bad position {position!r} in {path}")
        return position


__all__ = ["CONSUMERS_DIR", "ConsumerPositions"]
