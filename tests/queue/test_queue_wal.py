"""The write-ahead log: exact encoding, CRC-checked frames, torn tails, group commit."""

from __future__ import annotations

import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest

from persisting.errors import CorruptValueError
from persisting.lance_store import durable
from persisting.queue.codec import decode_record, encode_record
from persisting.queue.records import normalize_record
from persisting.queue.wal import MAGIC, WriteAheadLog, encode_frame, list_segments


def test_codec_round_trips_every_normalized_value() -> None:
    record = normalize_record(
        {
            "none": None,
            "t": True,
            "f": False,
            "i": -(2**63),
            "x": -0.5,
            "s": "ü∑",
            "b": b"\x00\x01",
            "l": [1, [2.5, None], {"k": "v"}],
            "d": {"a.b": {"c": []}},
            "arr": np.arange(4, dtype=">u2").reshape(2, 2),
        }
    )
    assert decode_record(encode_record(record)) == record
    assert type(decode_record(encode_record(record))["arr"]) is type(record["arr"])


@pytest.mark.parametrize("cut", [1, 5, 9, 17])
def test_codec_rejects_truncated_or_garbage_bytes(cut: int) -> None:
    data = encode_record({"key": "value", "n": [1, 2, 3]})
    with pytest.raises(CorruptValueError):
        decode_record(data[:-cut])
    with pytest.raises(CorruptValueError):
        decode_record(b"\xff" + data)


def test_codec_stores_numpy_subclasses_of_plain_types_as_plain_values() -> None:
    record = normalize_record({"f": np.float64(1.5), "s": np.str_("x"), "b": np.bytes_(b"y")})
    decoded = decode_record(encode_record(record))
    assert decoded == {"f": 1.5, "s": "x", "b": b"y"}
    assert [type(v) for v in decoded.values()] == [float, str, bytes]


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb([1, 2]),  # not a record
        msgpack.packb({"t": msgpack.ExtType(9, b"")}),  # an extension type nobody defined
        msgpack.packb({"t": msgpack.ExtType(1, b"\xc1")}),  # a tensor that is not msgpack
        msgpack.packb({"t": msgpack.ExtType(1, msgpack.packb(["numpy", "<f4", [1.5], b""]))}),
        msgpack.packb({1: "int key"}),
    ],
)
def test_codec_rejects_malformed_records_with_a_typed_error(payload: bytes) -> None:
    with pytest.raises(CorruptValueError):
        decode_record(payload)


def write_log(directory: Path, offsets: range, first: int | None = None) -> WriteAheadLog:
    wal = WriteAheadLog(directory)
    wal.start(offsets.start if first is None else first)
    for offset in offsets:
        wal.append(encode_frame(offset, 1000 + offset, f"payload-{offset}".encode()), 1)
    wal.sync()
    return wal


def test_replay_returns_every_record_in_order_across_segments(tmp_path: Path) -> None:
    wal = write_log(tmp_path, range(0, 5))
    wal.rotate(5)
    for offset in range(5, 8):
        wal.append(encode_frame(offset, offset, b"x" * offset), 1)
    wal.close()
    entries = WriteAheadLog(tmp_path).replay()
    assert [e.offset for e in entries] == list(range(8))
    assert entries[2].payload == b"payload-2" and entries[2].timestamp_us == 1002
    assert [first for first, _ in list_segments(tmp_path)] == [0, 5]


def test_a_torn_tail_is_ignored_and_cut_off(tmp_path: Path) -> None:
    write_log(tmp_path, range(0, 4)).close()
    (_, segment) = list_segments(tmp_path)[0]
    whole = segment.read_bytes()
    last_frame = len(encode_frame(3, 1003, b"payload-3"))
    for cut in range(1, last_frame):  # every way a crash can tear the last write
        segment.write_bytes(whole[:-cut])
        entries = WriteAheadLog(tmp_path).replay()
        assert [e.offset for e in entries] == [0, 1, 2]
        assert segment.stat().st_size == len(whole) - last_frame  # the torn bytes are gone


def test_a_checksum_mismatch_ends_the_log(tmp_path: Path) -> None:
    write_log(tmp_path, range(0, 4)).close()
    (_, segment) = list_segments(tmp_path)[0]
    data = bytearray(segment.read_bytes())
    second = len(MAGIC) + len(encode_frame(0, 1000, b"payload-0"))
    data[second + 30] ^= 0xFF  # flip a payload bit of record 1
    segment.write_bytes(bytes(data))
    assert [e.offset for e in WriteAheadLog(tmp_path).replay()] == [0]


def test_flushed_segments_are_dropped_and_the_active_one_kept(tmp_path: Path) -> None:
    wal = write_log(tmp_path, range(0, 3))
    wal.rotate(3)
    wal.append(encode_frame(3, 0, b"p"), 1)
    wal.rotate(4)
    assert len(list_segments(tmp_path)) == 3
    assert wal.drop_flushed(3) == 1  # segment [0, 3) is fully persisted
    assert wal.drop_flushed(4) == 1
    assert [first for first, _ in list_segments(tmp_path)] == [4]
    wal.close()


def test_group_commit_shares_fsyncs_between_concurrent_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.start(0)
    calls: list[int] = []
    real = durable.fsync_fd

    def traced(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr("persisting.queue.wal.fsync_fd", traced)
    lock = threading.Lock()
    barrier = threading.Barrier(8)
    next_offset = [0]

    def writer() -> None:
        for _ in range(5):
            with lock:  # the backend serializes appends the same way
                position = wal.append(encode_frame(next_offset[0], 0, b"r"), 1)
                next_offset[0] += 1
            barrier.wait()  # all eight puts are written before any asks for its fsync
            wal.sync(position)
            barrier.wait()

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wal.dirty
    assert len(calls) == 5  # one fsync acknowledged each group of eight puts
    wal.close()
    assert [e.offset for e in WriteAheadLog(tmp_path).replay()] == list(range(40))


def test_a_segment_of_an_unknown_format_is_refused_and_kept(tmp_path: Path) -> None:
    """A whole segment whose magic this version does not know is not a torn tail: replay
    refuses it with a typed error and leaves the file as it was (cutting it off could drop
    acknowledged records)."""
    wal = WriteAheadLog(tmp_path)
    wal.start(0)
    wal.append(encode_frame(0, 1, encode_record({"id": "a"})), 1)
    wal.sync()
    wal.close()
    ((_, path),) = list_segments(tmp_path)
    foreign = b"PQWAL001" + path.read_bytes()[len(MAGIC) :]
    path.write_bytes(foreign)
    with pytest.raises(CorruptValueError, match="unknown format"):
        WriteAheadLog(tmp_path).replay()
    assert path.read_bytes() == foreign
