"""A namespace's metadata and payload files reconciled at open: rows whose files are gone
are dropped (:func:`index_rows`), and files the index does not know are judged: adopted,
quarantined or put back.

A namespace's directory can hold payload files its metadata never recorded: written by a
process that died before its metadata commit, by another live process, or planted and
copied in. :class:`FileJudge` decides each one's fate from its header alone:

- sealed with a key of the root, whole and named after its key: adopted (indexed);
- a second copy of a key already indexed: deleted (nothing is lost);
- anything else -- unsealed, damaged, truncated, misnamed: quarantined
  (:mod:`persisting.kv.disk.quarantine`), never deleted and never served.

A process that sees the root's current key is no longer the one it opened with does not
quarantine unsealed files in that pass (another process may be sealing with a key it has
not seen yet); it only adopts what verifies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from persisting.errors import CorruptValueError
from persisting.kv.disk.metadata import MetaRow
from persisting.kv.disk.payload_files import (
    FileHeader,
    PayloadFiles,
    UnsealedFileError,
    round_to_block,
)
from persisting.kv.disk.quarantine import Quarantine
from persisting.kv.index import DiskEntry, LruIndex
from persisting.kv.keys import key_hash
from persisting.lance_store.access import make_dir

log = logging.getLogger(__name__)

_PAYLOAD_NAME = re.compile(r"^([0-9a-f]{16})-([0-9a-f]{8})\.kv(?:\.\d+)?$")


@dataclass(slots=True)
class Verdicts:
    """What the judge did, counted for a store's figures."""

    foreign: int = 0
    damaged: int = 0
    quarantined: int = 0
    restored: int = 0


class FileJudge:
    """Judges the payload files of one namespace. ``release(nbytes)`` is told the bytes a
    file no longer takes in the payload directory (moved aside or deleted)."""

    def __init__(self, files: PayloadFiles, quarantine: Quarantine, release: Callable[[int], None]):
        self.files = files
        self.quarantine = quarantine
        self._release = release
        self.verdicts = Verdicts()

    def header(self, path: Path, h: int, *, judging: bool) -> FileHeader | None:
        """The header of unknown file ``path`` (named for key hash ``h``) if it may be
        adopted; otherwise None, with the file quarantined (or, while not ``judging``, an
        unsealed one left where it is)."""
        try:
            header = self.files.read_header(path)
        except FileNotFoundError:
            return None
        except UnsealedFileError:
            self.verdicts.foreign += 1
            if judging:
                self.set_aside(path, "not sealed with a key of this storage root")
            return None
        except (CorruptValueError, OSError, ValueError, KeyError) as exc:
            self.verdicts.damaged += 1
            self.set_aside(path, f"damaged: {exc}")
            return None
        if key_hash(header.key) != h:
            self.set_aside(path, "its name is not its key's")
            return None
        return header

    def drop_copy(self, path: Path) -> None:
        """Delete a second copy of a key already indexed."""
        size = _size(path)
        if size is not None and self.files.unlink(path):
            self._release(round_to_block(size))

    def set_aside(self, path: Path, why: str) -> None:
        size = _size(path)
        if size is not None and self.quarantine.take(path, why):
            self.verdicts.quarantined += 1
            self._release(round_to_block(size))

    def adopt(
        self,
        on_disk: Mapping[tuple[int, int], Path],
        index: LruIndex[DiskEntry],
        *,
        judging: bool,
    ) -> list[MetaRow]:
        """Index the files of ``on_disk`` (by key hash and tag) that ``index`` does not know
        and that may be adopted (:meth:`header`); their metadata rows. A second copy of a
        key already indexed is deleted."""
        known = {(key_hash(k), e.tag) for k, e in index.items()}
        adopted: list[MetaRow] = []
        for (h, tag), path in on_disk.items():
            if (h, tag) in known:
                continue
            header = self.header(path, h, judging=judging)
            if header is None:
                continue
            if header.key in index:
                self.drop_copy(path)
                continue
            entry = DiskEntry(header.layout, header.checksum, header.parent, tag)
            index.add(header.key, entry, sighting=False)
            adopted.append(
                MetaRow(header.key, tag, header.layout, header.checksum, header.parent, path)
            )
        return adopted

    def put_back_verified(self) -> int:
        """Move quarantined files that now verify, header and payload (their key came
        back), to their places; returns how many. Their bytes are counted again by the
        caller's recount. Each file is read whole: the quarantine is the operator's to
        empty, and a file is only read again while it stays there."""
        restored = 0
        for path in self.quarantine.files():
            match = _PAYLOAD_NAME.match(path.name)
            if match is None:
                continue
            h, tag = int(match.group(1), 16), int(match.group(2), 16)
            try:
                header = self.files.read_header(path)
                whole = bytearray(header.layout.nbytes)
                intact = self.files.read_into(path, memoryview(whole)) == header.checksum
            except (CorruptValueError, OSError, ValueError, KeyError):
                continue
            if key_hash(header.key) != h or not intact:
                continue  # still unverifiable: a damaged payload stays aside
            target = self.files.path(header.key, tag)
            make_dir(target.parent, self.files.modes)
            if self.quarantine.put_back(path, target):
                restored += 1
                log.warning("put back %s: it verifies under a key of the root", target)
        self.verdicts.restored += restored
        return restored


def index_rows(
    rows: Iterable[MetaRow], on_disk: Mapping[tuple[int, int], Path], index: LruIndex[DiskEntry]
) -> list[tuple[str, int]]:
    """Index the metadata ``rows`` whose payload files are in ``on_disk``; the ``(key,
    tag)`` of the others (their files were evicted or removed before their rows were, or
    a row is a second one for an indexed key), for the caller to delete."""
    stale: list[tuple[str, int]] = []
    for row in rows:
        existing = index.get(row.key)
        if existing is not None and existing.tag == row.tag:
            continue  # the same file recorded twice (adopted by two processes)
        if existing is not None or (key_hash(row.key), row.tag) not in on_disk:
            stale.append((row.key, row.tag))
            continue
        index.add(row.key, DiskEntry(row.layout, row.checksum, row.parent, row.tag), sighting=False)
    return stale


def _size(path: Path) -> int | None:
    with contextlib.suppress(FileNotFoundError):
        return os.stat(path).st_size
    return None


__all__ = ["FileJudge", "Verdicts", "index_rows"]
