"""Payload files: one self-describing file per stored chunk.

Each chunk's bytes live in their own file, ``payload/<hh>/<keyhash>-<tag>.kv``: a 4 KiB
header (key, layout, payload checksum, parent, sealed with the root's key: see
:mod:`~persisting.kv.disk.file_header`) followed by the payload at a page-aligned offset. Files
are written under a ``.tmp`` name, fsynced when the put must be durable, then renamed into
place, so a ``.kv`` file is always whole.
Eviction unlinks the file, which gives its space back at once; a reader that already
opened it still reads the whole, correct file.

An in-flight file is written beside the place it will land, as
``payload/<hh>/<random>-<tag>-<reserved bytes>.tmp``, and renamed within that directory: a
``du`` that lists the directory sees the file once, under one name or the other (a rename
from another directory could be counted twice by a ``du`` walking both). Its writer holds an
exclusive ``flock`` on it from creation until after the rename. That lock is the proof of
life (:mod:`~persisting.kv.disk.liveness`): a file nobody holds locked belongs to a dead
writer and may be removed (two stores of one process share a pid, so no pid in a name
could say so). Each open store also holds a lock
on a file of its own in ``writers/``: finding one unlocked says a writer died, and only
then are the ``payload/<hh>`` directories searched for its in-flight files, so the put path
pays nothing for it. ``reservations/`` holds empty, locked
``<random>-<tag>-<reserved bytes>.tmp`` files: reservations of metadata growth, whose lock
proves their holder alive the same way (from older versions, ``tmp/`` may hold whole
in-flight files, found and reclaimed the same way).

Payload bytes are read with :func:`~persisting.kv.disk.range_reads.read_file_range` (positioned
reads straight into the destination, hashed as they land).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from persisting.errors import CorruptValueError, StorageIOError
from persisting.kv.disk import direct_io, liveness
from persisting.kv.disk.file_header import BLOCK, HEADER_BYTES, FileHeader, UnsealedFileError
from persisting.kv.disk.liveness import (
    Reservation,
    create_locked,
    io_error,
    reservations_in,
    reserved_of,
    unlink_quietly,
)
from persisting.kv.disk.range_reads import read_file_range
from persisting.kv.keys import key_hash
from persisting.kv.layout import HASH_PIECE, Payload, payload_parts
from persisting.lance_store.access import (
    CONTROL_FILE_MODE,
    OWNER_ONLY,
    FileModes,
    make_dir,
    restrict,
)
from persisting.lance_store.durable import fsync_dir, fsync_fd
from persisting.lance_store.root_keys import RootKeys

#: Files of one durable batch written (and fsynced) at once.
WRITE_THREADS = 8
#: Piece a payload is written in when its writer has a checkpoint between pieces: a whole
#: number of :data:`~persisting.kv.layout.HASH_PIECE` s (a hashed write checks at the start
#: of every hash piece that starts a pause piece).
PAUSE_PIECE = 16 * HASH_PIECE
#: Called between the pieces of a file being written and before its fsync; it may raise
#: to abandon the write (a low-priority write-behind handing its batch over, see
#: :mod:`persisting.kv.disk.write_behind`): the file is then removed, never published.
Pause = Callable[[], None]


def round_to_block(n: int) -> int:
    """``n`` rounded up to whole :data:`BLOCK` s (how disk use is counted)."""
    return -(-n // BLOCK) * BLOCK


def file_size(nbytes: int) -> int:
    """Bytes a payload file of ``nbytes`` occupies on disk (header + payload, block-rounded)."""
    return HEADER_BYTES + round_to_block(nbytes)


@dataclass(slots=True)
class PendingFile:
    """A payload file being written: its open, locked tmp file and where it will land."""

    fd: int
    tmp: Path
    final: Path
    #: ``fd`` was opened with O_DIRECT (until a write that O_DIRECT cannot move takes it off).
    direct: bool = False


@dataclass
class CreatedFiles:
    """A batch's files just created (:meth:`PayloadFiles.create`): the bytes their creation
    added to directories (``grown``), and each destination directory's allocated bytes
    once they were all created (``allocated``)."""

    pending: list[PendingFile]
    grown: int
    allocated: dict[Path, int]


class PayloadFiles:
    """The payload directory of one model namespace."""

    def __init__(
        self, directory: Path, keys: RootKeys, modes: FileModes = OWNER_ONLY, direct: bool = False
    ):
        self.directory = directory
        self.modes = modes
        #: Move aligned payloads with O_DIRECT (see :mod:`persisting.kv.disk.direct_io`); cleared
        #: once the filesystem refuses it.
        self.direct = direct
        #: The storage root's keys: headers are sealed with one (see :class:`FileHeader`).
        self.keys = keys
        self.payload_dir = directory / "payload"
        self._payload_text = str(self.payload_dir)
        self.tmp_dir = directory / "tmp"
        self.reservations_dir = directory / "reservations"
        self.writers_dir = directory / "writers"
        #: ``payload/<hh>`` directories created whose entry is not yet synced.
        self._new_subdirs: set[Path] = set()
        #: Threads writing the files of a durable batch (started with the first one).
        self._writers: ThreadPoolExecutor | None = None
        self._writers_lock = threading.Lock()
        make_dir(self.payload_dir, modes)  # writers/, reservations/: on first use

    def path(self, key: str, tag: int) -> Path:
        return Path(self.path_text(key, tag))

    def path_text(self, key: str, tag: int) -> str:
        """:meth:`path` as a string, without building a Path (every read opens one)."""
        h = key_hash(key)
        return f"{self._payload_text}/{h >> 56:02x}/{h:016x}-{tag:08x}.kv"

    @staticmethod
    def new_tag() -> int:
        return secrets.randbits(32)

    def create(self, files: Sequence[tuple[str, int, int]]) -> CreatedFiles:
        """Create and lock the tmp file of each write ``(key, tag, reserved bytes)`` beside
        its final place (named with its reservation), and say what the directories grew
        by (new ``payload/<hh>`` directories, new directory blocks): each directory is
        measured once before the batch and once after, not around every file.

        Called under the usage lock, so a usage recount never misses a reserved write. On
        failure the files created so far are removed.
        """
        finals = [self.path(key, tag) for key, tag, _reserved in files]
        watched = {self.payload_dir: _lstat(self.payload_dir)}
        for final in finals:
            watched.setdefault(final.parent, _lstat(final.parent))
        before = {d: _blocks(st) for d, st in watched.items()}
        pending: list[PendingFile] = []
        try:
            for final, (_key, tag, reserved) in zip(finals, files, strict=True):
                subdir = final.parent
                found = watched[subdir]
                if found is None or not stat.S_ISDIR(found.st_mode):
                    try:
                        self._make_subdir(subdir)
                    except OSError as exc:
                        raise io_error(f"cannot create {subdir}", exc) from exc
                    watched[subdir] = _lstat(subdir)
                tmp = subdir / f"{secrets.token_hex(8)}-{tag:08x}-{reserved}.tmp"
                pending.append(self._create_tmp(tmp, final))
        except BaseException:
            for done in pending:
                self.abort(done)
            raise
        after = {d: _allocated(d) for d in watched}
        grown = sum(max(0, after[d] - before[d]) for d in watched)
        del after[self.payload_dir]
        return CreatedFiles(pending, grown, after)

    def _create_tmp(self, tmp: Path, final: Path) -> PendingFile:
        """Create and lock an in-flight file; with :attr:`direct`, opened for O_DIRECT at
        once (no second open to write it). A filesystem that refuses O_DIRECT (overlayfs,
        older tmpfs) may create the file first: it is removed, made again without, and
        :attr:`direct` is cleared (not tried again)."""
        if self.direct and direct_io.open_flags():
            try:
                fd = create_locked(tmp, self.modes.file, direct_io.open_flags())
                return PendingFile(fd, tmp, final, direct=True)
            except StorageIOError as exc:
                cause = exc.__cause__
                if not (isinstance(cause, OSError) and direct_io.refused(cause)):
                    raise
                self.direct = False
                unlink_quietly(tmp)
        return PendingFile(create_locked(tmp, self.modes.file), tmp, final)

    def register_writer(self) -> Reservation:
        """This store's own locked file in ``writers/``, held while it is open: whoever
        finds it unlocked knows a writer died (see :meth:`dead_writers`)."""
        path = self.writers_dir / f"{secrets.token_hex(8)}.lock"
        if not self.writers_dir.is_dir():
            make_dir(self.writers_dir, self.modes)
        # 0600 whatever the access setting: who can open it can hold its lock, and a dead
        # writer would then look alive for ever (its in-flight files never reclaimed).
        return Reservation(create_locked(path, CONTROL_FILE_MODE), path, 0)

    def dead_writers(self) -> list[Path]:
        """The ``writers/`` files of stores that died open (nobody holds their lock)."""
        try:
            entries = list(os.scandir(self.writers_dir))
        except FileNotFoundError:
            return []
        return [Path(e.path) for e in entries if self.remove_if_abandoned(Path(e.path), keep=True)]

    def reserve_file(self, nbytes: int) -> Reservation:
        """An empty, locked file in ``reservations/`` holding a reservation of ``nbytes``
        (metadata growth) in its name: while its holder lives the bytes stay counted, and
        once it dies :meth:`~persisting.kv.budget.shared_usage.SharedUsage.reclaim_abandoned`
        gives them back. Called under the usage lock."""
        name = f"{secrets.token_hex(8)}-{self.new_tag():08x}-{nbytes}.tmp"
        path = self.reservations_dir / name
        if not self.reservations_dir.is_dir():
            make_dir(self.reservations_dir, self.modes)
        return Reservation(create_locked(path, CONTROL_FILE_MODE), path, nbytes)  # as above

    @staticmethod
    def release_file(reservation: Reservation) -> None:
        """Remove a reservation file (unlinked while still locked, then let go)."""
        unlink_quietly(reservation.path)
        with contextlib.suppress(OSError):
            os.close(reservation.fd)

    def finish(
        self, pending: PendingFile, header: FileHeader, payload: Payload, *, durable: bool
    ) -> Path:
        """Write header and payload, fsync if ``durable``, and rename the file into place.

        The caller fsyncs the destination directories (:meth:`sync_dirs`) once per batch to
        make the renames durable. The tmp file stays locked until it has its final name.
        """
        self.write(pending, header, payload, durable=durable)
        return self.publish(pending)

    def write(
        self,
        pending: PendingFile,
        header: FileHeader,
        payload: Payload,
        *,
        durable: bool,
        hashed: bool = False,
        pause: Pause | None = None,
    ) -> FileHeader:
        """Write header and payload into the tmp file, fsync it if ``durable`` (thread-safe
        per file: a batch writes its files on several threads, so their syncs can share
        the filesystem's journal commits). On failure the tmp file is removed. Returns the
        header written. A :class:`~persisting.kv.layout.Gathered` payload is written from
        its parts, end to end.

        With ``hashed`` the header's checksum is not known yet: the payload is written
        first, in pieces, each hashed right after it is written (while still in cache: one
        pass over the caller's memory instead of two), then the header with that checksum.
        The tmp file is only published once whole, so a torn one is never visible.
        With ``pause`` the payload is written in pieces with ``pause()`` called before each,
        and before the fsync (which pushes the file to the disk, as costly beside reads as
        the writes themselves). With :attr:`direct`, a hashed payload whose memory and size
        O_DIRECT takes is hashed first and written with its header, O_DIRECT, in one call;
        so is one whose checksum is known (the fsync then has only the metadata left)."""
        try:
            done = self._write_direct(pending, header, payload, hashed, pause)
            if done is None:
                done = self._write_buffered(pending, header, payload, hashed, pause)
            header = done
            if durable:
                if pause is not None:
                    pause()  # the fsync pushes the file to the disk: not beside reads
                fsync_fd(pending.fd)
        except OSError as exc:
            self.abort(pending)
            raise io_error(f"writing {pending.final.name} failed", exc) from exc
        return header

    def _write_direct(
        self,
        pending: PendingFile,
        header: FileHeader,
        payload: Payload,
        hashed: bool,
        pause: Pause | None,
    ) -> FileHeader | None:
        """Header and payload in one O_DIRECT write (the payload hashed first if ``hashed``);
        the header written, or None, nothing written, when the tmp file is not open for
        O_DIRECT, O_DIRECT does not take the payload's memory or size, or the filesystem
        refuses it (then :attr:`direct` is cleared: not tried again)."""
        if not pending.direct or not isinstance(payload, memoryview):
            return None
        if not direct_io.aligned(payload, HEADER_BYTES):
            return None
        if pause is not None:
            pause()
        if hashed:
            digest = direct_io.write_hashed(
                pending.fd, payload, HEADER_BYTES, functools.partial(self._head, header)
            )
            written = digest is not None
            if digest is not None:
                header = header.with_checksum(digest)
        else:
            head = header.encode(self.keys.sealing)
            written = direct_io.write(pending.fd, payload, HEADER_BYTES, head)
        if not written:
            self.direct = False
        return header if written else None

    def _write_buffered(
        self,
        pending: PendingFile,
        header: FileHeader,
        payload: Payload,
        hashed: bool,
        pause: Pause | None,
    ) -> FileHeader:
        """Header and payload through the page cache (see :meth:`write`); the header
        written."""
        if pending.direct:  # a value O_DIRECT cannot move
            direct_io.buffered(pending.fd)
            pending.direct = False
        seal = self.keys.sealing
        if hashed:
            digest = _write_hashed(pending.fd, payload, HEADER_BYTES, pause)
            header = header.with_checksum(digest)
            _write_all(pending.fd, [header.encode(seal)], offset=0)
        elif pause is not None:
            _write_all(pending.fd, [header.encode(seal)], offset=0)
            _write_paused(pending.fd, payload, HEADER_BYTES, pause)
        else:
            _write_all(pending.fd, [header.encode(seal), *payload_parts(payload)])
        return header

    def _head(self, header: FileHeader, checksum: int) -> bytes:
        return header.with_checksum(checksum).encode(self.keys.sealing)

    def write_batch(
        self,
        pending: list[PendingFile],
        headers: list[FileHeader],
        payloads: list[Payload],
        *,
        durable: bool,
        hashed: list[bool] | None = None,
        pause: Pause | None = None,
        writers: Executor | None = None,
    ) -> list[FileHeader]:
        """:meth:`write` each file of a batch. Several at once when the batch must be
        durable: concurrent fsyncs share the filesystem's journal commits, where one after
        another each waits for a commit of its own. On failure every tmp file of the batch
        is removed and the first error raised (once no writer runs any more). ``hashed``
        says per file whether its checksum is made as it is written, ``pause`` is called
        between the pieces of every file (see :meth:`write`), ``writers`` (default: this
        object's own threads) write the files of a durable batch; returns the headers
        written."""
        hashes = hashed if hashed is not None else [False] * len(pending)
        if not durable or len(pending) == 1:
            return [
                self.write(p, header, payload, durable=durable, hashed=h, pause=pause)
                for p, header, payload, h in zip(pending, headers, payloads, hashes, strict=True)
            ]
        if writers is None:
            with self._writers_lock:
                if self._writers is None:
                    self._writers = ThreadPoolExecutor(
                        WRITE_THREADS, thread_name_prefix="persisting-kv-write"
                    )
                writers = self._writers
        futures: list[Future[FileHeader]] = []
        for p, header, payload, h in zip(pending, headers, payloads, hashes, strict=True):
            write = functools.partial(self.write, p, header, payload, durable=True, hashed=h)
            try:
                futures.append(writers.submit(write, pause=pause))
            except RuntimeError:  # the pool is shut down: the interpreter is exiting
                futures.append(_inline(write, pause=pause))
        failure: BaseException | None = None
        for future in futures:
            failure = failure or future.exception()
        if failure is not None:
            for p in pending:
                self.abort(p)
            raise failure
        return [future.result() for future in futures]

    def close(self) -> None:
        """Stop the writer threads (a no-op when none was started)."""
        with self._writers_lock:
            writers, self._writers = self._writers, None
        if writers is not None:
            writers.shutdown(wait=True)

    def publish(self, pending: PendingFile) -> Path:
        """Rename a written tmp file into place (within its directory) and let go of it."""
        try:
            os.rename(pending.tmp, pending.final)
        except OSError as exc:
            self.abort(pending)
            raise io_error(f"cannot move {pending.tmp} into place", exc) from exc
        os.close(pending.fd)
        pending.fd = -1
        return pending.final

    def _make_subdir(self, path: Path) -> None:
        """Create a ``payload/<hh>`` directory on first use (OSError keeps its errno, so a
        full filesystem still reads as one). Its entry in ``payload/`` is made durable by
        :meth:`sync_dirs` with the batch that created it."""
        if path.is_dir():
            return
        try:
            path.mkdir(mode=self.modes.directory)
        except FileExistsError:
            return
        restrict(path, self.modes.directory)
        self._new_subdirs.add(path)

    @staticmethod
    def abort(pending: PendingFile) -> None:
        unlink_quietly(pending.tmp)  # before closing: unlocked, it could be taken for dead
        if pending.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(pending.fd)
            pending.fd = -1

    def sync_dirs(self, paths: list[Path]) -> None:
        """Make the renames of ``paths`` durable: fsync each destination directory once, and
        ``payload/`` itself when a ``payload/<hh>`` directory was created since the last
        call (else a crash could lose that directory, with every file renamed into it).

        Called after the whole batch is renamed: on journalling filesystems the first
        directory sync commits every rename of the batch, and the others find nothing left
        to do."""
        directories = sorted({p.parent for p in paths})
        created = [d for d in directories if d in self._new_subdirs]
        for directory in directories:
            fsync_dir(directory)
        if created:
            fsync_dir(self.payload_dir)
            self._new_subdirs.difference_update(created)

    def read_into(
        self,
        path: str | os.PathLike[str],
        out: memoryview,
        *,
        executor: Executor | None = None,
        parts: int = 1,
    ) -> int:
        """Read the payload of ``path`` into ``out`` (exactly ``len(out)`` bytes), in
        ``parts`` reads at once on ``executor`` when given, and return its checksum
        (:func:`persisting.kv.layout.checksum`), made as it is read.

        Raises FileNotFoundError if the file is gone (evicted), CorruptValueError if short.
        With :attr:`direct`, an aligned ``out`` is read with O_DIRECT, then hashed.
        """
        if self.direct and direct_io.aligned(out, HEADER_BYTES):
            found = direct_io.read_hashed(path, out, HEADER_BYTES)
            if found is not None:
                return found
            self.direct = False
        digest = read_file_range(
            path,
            HEADER_BYTES,
            out,
            executor=executor,
            parts=parts,
            hashed=True,
        )
        assert digest is not None
        return digest

    def read_header(self, path: Path) -> FileHeader:
        """The header of ``path``, if sealed with a key of this root (else
        :class:`UnsealedFileError`), and whole (else :class:`CorruptValueError`)."""
        with open(path, "rb") as f:
            header = FileHeader.decode(f.read(HEADER_BYTES), self.keys)
            f.seek(0, os.SEEK_END)
            if f.tell() < HEADER_BYTES + header.layout.nbytes:
                raise CorruptValueError(f"{path.name} is truncated")
        return header

    @staticmethod
    def unlink(path: Path) -> bool:
        """Remove a payload file; False if it was already gone."""
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def scan(self) -> Iterator[tuple[Path, int, int]]:
        """Every payload file as ``(path, key hash, tag)`` (names we did not make are skipped)."""
        return scan_payload(self.directory)

    def subdirs(self) -> Iterator[Path]:
        """The ``payload/<hh>`` directories that exist now."""
        return payload_subdirs(self.directory)

    def reservation_files(self) -> Iterator[tuple[Path, int]]:
        """Metadata reservations as ``(path, reserved bytes)``, live or abandoned."""
        yield from reservations_in(self.reservations_dir)

    def tmp_files(self) -> Iterator[tuple[Path, int]]:
        """Whole in-flight files older versions wrote in ``tmp/``, as ``(path, reserved
        bytes)``, live or abandoned."""
        yield from reservations_in(self.tmp_dir)

    def census(self) -> Iterator[tuple[Path, int | None]]:
        """Every payload file as ``(path, None)`` and every in-flight one as ``(path,
        reserved bytes)``: one listing per ``payload/<hh>`` directory, so a file renamed
        into place meanwhile is seen once. Slow (every directory): for a recount only."""
        for subdir in self.subdirs():
            try:
                names = os.listdir(subdir)
            except FileNotFoundError:
                continue
            for name in names:
                if name.endswith(".kv") and len(name) == 28:
                    yield subdir / name, None
                elif (reserved := reserved_of(name)) is not None:
                    yield subdir / name, reserved

    remove_if_abandoned = staticmethod(liveness.remove_if_abandoned)


def payload_subdirs(directory: Path) -> Iterator[Path]:
    """The ``payload/<hh>`` directories of namespace ``directory`` that exist now."""
    try:
        entries = list(os.scandir(directory / "payload"))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield Path(entry.path)


def scan_payload(directory: Path) -> Iterator[tuple[Path, int, int]]:
    """Every payload file of namespace ``directory`` as ``(path, key hash, tag)``, names we
    did not make skipped; reads the directories only (creates nothing)."""
    for sub in payload_subdirs(directory):
        try:
            entries = list(os.scandir(sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            name = entry.name
            if not name.endswith(".kv") or len(name) != 28:
                continue
            try:
                h, tag = int(name[:16], 16), int(name[17:25], 16)
            except ValueError:
                continue
            yield Path(entry.path), h, tag


def _inline(fn: Callable[..., FileHeader], *args: Any, **kwargs: Any) -> Future[FileHeader]:
    """Run ``fn`` now, on this thread, as a completed future (outcome or exception)."""
    future: Future[FileHeader] = Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as exc:
        future.set_exception(exc)
    return future


def _allocated(path: str | os.PathLike[str]) -> int:
    return _blocks(_lstat(path))


def _lstat(path: str | os.PathLike[str]) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _blocks(st: os.stat_result | None) -> int:
    return 0 if st is None else st.st_blocks * 512


def _write_hashed(fd: int, payload: Payload, offset: int, pause: Pause | None = None) -> int:
    """Write ``payload`` at ``offset`` in :data:`HASH_PIECE` pieces, hashing each piece
    right after it is written (``pause()`` before every :data:`PAUSE_PIECE`); returns the
    xxh3-64 of the whole payload (of its parts end to end)."""
    digest = xxhash.xxh3_64()
    done = 0
    for part in payload_parts(payload):
        view = memoryview(part).cast("B")
        for start in range(0, len(view), HASH_PIECE):
            if pause is not None and (done + start) % PAUSE_PIECE < HASH_PIECE:
                pause()
            piece = view[start : start + HASH_PIECE]
            _write_all(fd, [piece], offset=offset + done + start)
            digest.update(piece)
        done += len(view)
    return digest.intdigest()


def _write_paused(fd: int, payload: Payload, offset: int, pause: Pause) -> None:
    """Write ``payload`` at ``offset`` in :data:`PAUSE_PIECE` pieces, ``pause()`` before each."""
    for part in payload_parts(payload):
        view = memoryview(part).cast("B")
        for start in range(0, len(view), PAUSE_PIECE):
            pause()
            _write_all(fd, [view[start : start + PAUSE_PIECE]], offset=offset + start)
        offset += len(view)


def _write_all(fd: int, buffers: list[bytes | memoryview], offset: int | None = None) -> None:
    """Write every byte of ``buffers`` at the file position, or at ``offset`` if given."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        if offset is None:
            written = os.writev(fd, views)
        else:
            written = os.pwritev(fd, views, offset)
            offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


__all__ = [
    "BLOCK",
    "HEADER_BYTES",
    "FileHeader",
    "Pause",
    "PayloadFiles",
    "PendingFile",
    "Reservation",
    "UnsealedFileError",
    "file_size",
    "payload_subdirs",
    "round_to_block",
    "scan_payload",
]
