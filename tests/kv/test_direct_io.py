"""A store with ``direct_io``: aligned payloads move with O_DIRECT, every other one through
the page cache, and both are checksummed as any other payload."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from persisting.kv import KVStore, Layout, open_kv_store
from persisting.kv.disk import direct_io
from persisting.kv.disk.file_header import HEADER_BYTES, FileHeader

MODEL = "vllm.direct.0123456789abcdef"


def key(i: int) -> str:
    return f"{MODEL}@1@0@{i:064x}@bfloat16@g%0"


def store_of(root: Path) -> KVStore:
    return open_kv_store(
        root, MODEL, memory_bytes=0, disk_bytes="64MiB", fsync=False, direct_io=True
    )


def aligned_buffer(nbytes: int, fill: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, nbytes))  # page-aligned
    np.frombuffer(view, np.uint8)[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8) ^ fill
    return view


def test_aligned_and_unaligned_values_round_trip(tmp_path: Path) -> None:
    aligned = aligned_buffer(64 << 10, 7)
    unaligned = os.urandom(5000)
    assert direct_io.aligned(aligned, 4096) and not direct_io.aligned(memoryview(unaligned), 4096)
    with store_of(tmp_path) as store:
        store.put(key(1), aligned, fmt="binary", check_shape=False)
        store.put(key(2), unaligned, fmt="binary", check_shape=False)
    with store_of(tmp_path) as store:  # a new store: from the files
        back = aligned_buffer(64 << 10, 0)
        assert store.get_into(key(1), back) is not None
        assert bytes(back) == bytes(aligned)
        other = bytearray(5000)
        assert store.get_into(key(2), other) is not None and bytes(other) == unaligned


def test_a_damaged_direct_payload_is_a_miss(tmp_path: Path) -> None:
    with store_of(tmp_path) as store:
        store.put(key(3), aligned_buffer(64 << 10, 3), fmt="binary", check_shape=False)
    (path,) = tmp_path.rglob("*.kv")
    with open(path, "r+b") as f:
        f.seek(4096 + 1000)
        f.write(b"\xff" * 8)
    with store_of(tmp_path) as store:
        assert store.get_into(key(3), aligned_buffer(64 << 10, 0)) is None
        assert not store.contains(key(3))  # dropped, counted
        assert store.stats()["corruptions"] == 1


def test_the_header_goes_with_the_payload_in_one_direct_write(tmp_path: Path) -> None:
    """A direct payload's header is written by the same O_DIRECT call, never left a dirty
    page of its own for the next flush; it names the key and the payload's checksum."""
    path = tmp_path / "f"
    path.touch()
    payload = aligned_buffer(64 << 10, 5)
    fd = os.open(path, os.O_WRONLY | direct_io.open_flags())
    try:
        assert direct_io.write(fd, payload, 4096, head=b"h" * 4096)
        with pytest.raises(ValueError):
            direct_io.write(fd, payload, 4096, head=b"h" * 100)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"h" * 4096 + bytes(payload)
    with store_of(tmp_path / "root") as store:
        store.put(key(4), payload, fmt="binary", check_shape=False)
    (kv,) = (tmp_path / "root").rglob("*.kv")
    header = FileHeader.decode(kv.read_bytes()[:HEADER_BYTES], None)
    assert header.key == key(4)
    assert header.checksum == xxhash.xxh3_64_intdigest(payload)


def test_an_owned_durable_put_is_written_direct_under_its_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value received into a memory-tier buffer (``batched_put_owned``, its checksum
    known: a server's put) is written with O_DIRECT too, header and all, and fsynced."""
    direct_writes: list[int] = []
    write = direct_io.write

    def counting(fd: int, view: memoryview, offset: int, head: bytes = b"") -> bool:
        direct_writes.append(len(view))
        return write(fd, view, offset, head)

    monkeypatch.setattr(direct_io, "write", counting)
    root = tmp_path / "root"
    with open_kv_store(
        root, MODEL, memory_bytes="16MiB", disk_bytes="64MiB", direct_io=True
    ) as store:
        buffers = [store.allocate(64 << 10) for _ in range(2)]
        for i, buffer in enumerate(buffers):
            buffer[:] = np.frombuffer(aligned_buffer(64 << 10, i + 1), np.uint8)
        layout = Layout((64 << 10,), "uint8", "binary", 64 << 10, "bytes")
        digests = [xxhash.xxh3_64_intdigest(b.tobytes()) for b in buffers]
        results = store.batched_put_owned([key(5), key(6)], buffers, [layout] * 2, digests)
        assert all(r.durable for r in results)
    assert direct_writes == [64 << 10, 64 << 10]
    for kv in root.rglob("*.kv"):
        header = FileHeader.decode(kv.read_bytes()[:HEADER_BYTES], None)
        i = [key(5), key(6)].index(header.key)
        assert header.checksum == digests[i]
        assert kv.read_bytes()[HEADER_BYTES:] == bytes(aligned_buffer(64 << 10, i + 1))


def test_a_direct_payload_file_is_opened_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An in-flight file is opened for O_DIRECT when it is created: its payload write
    needs no second open (and an unaligned value's file, through the page cache, none
    either)."""
    opened: list[str] = []
    real_open = os.open

    def counting(path: str | os.PathLike[str], flags: int, *args: int, **kw: int) -> int:
        opened.append(os.fspath(path))
        return real_open(path, flags, *args, **kw)

    with store_of(tmp_path) as store:
        monkeypatch.setattr(os, "open", counting)
        store.put(key(7), aligned_buffer(64 << 10, 3), fmt="binary", check_shape=False)
        store.put(key(8), os.urandom(5000), fmt="binary", check_shape=False)
        monkeypatch.undo()
        tmp_opens = [p for p in opened if p.endswith(".tmp")]
        assert len(tmp_opens) == 2 and len(set(tmp_opens)) == 2
        assert bytes(store.get(key(7)) or b"") == bytes(aligned_buffer(64 << 10, 3))
        assert len(bytes(store.get(key(8)) or b"")) == 5000


def test_a_filesystem_refusing_o_direct_when_a_file_is_created_gets_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overlayfs and older tmpfs create the file, then refuse O_DIRECT with EINVAL (this
    kernel's filesystems all take it, so the refusal is injected at the one ``os.open``
    that asks for it): the put still lands, through the page cache, and direct I/O is not
    tried again."""
    real_open = os.open
    refused: list[str] = []

    def refusing(path: str | os.PathLike[str], flags: int, *args: int, **kw: int) -> int:
        if flags & direct_io.open_flags() and flags & os.O_CREAT:
            os.close(real_open(path, flags & ~direct_io.open_flags(), *args, **kw))
            refused.append(os.fspath(path))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    payload = aligned_buffer(64 << 10, 9)
    with store_of(tmp_path) as store:
        monkeypatch.setattr(os, "open", refusing)
        store.put(key(9), payload, fmt="binary", check_shape=False)
        store.put(key(10), aligned_buffer(64 << 10, 10), fmt="binary", check_shape=False)
        monkeypatch.undo()
        assert len(refused) == 1  # not tried again
        assert not Path(refused[0]).exists()  # the refused file was not left behind
        assert bytes(store.get(key(9)) or b"") == bytes(payload)
    assert not list(tmp_path.rglob("*.tmp"))
    with store_of(tmp_path) as store:
        assert bytes(store.get(key(9)) or b"") == bytes(payload)
        assert store.contains(key(10))
