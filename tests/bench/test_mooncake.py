"""Mooncake's trace format, read as it is; every line it cannot use is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persisting.bench.mooncake import read_mooncake, trace_format
from persisting.bench.trace import TraceSpec, generate_trace, write_trace
from persisting.cli import app
from persisting.errors import InvalidValueError

RECORDS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]},
    {"timestamp": 27, "input_length": 600, "output_length": 2, "hash_ids": [0, 3]},
    {"timestamp": 27, "input_length": 512, "output_length": 1, "hash_ids": [0], "extra": "ok"},
]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_records_become_blocks_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [json.dumps(r) for r in RECORDS])
    trace = read_mooncake(path)
    assert [r.blocks for r in trace.requests] == [(0, 1, 2), (0, 3), (0,)]
    assert [r.t for r in trace.requests] == [0.0, 0.027, 0.027]  # milliseconds -> seconds
    assert [r.line for r in trace.requests] == [1, 2, 3]
    assert trace.block_tokens == 512 and trace.references == 6
    assert trace.distinct_blocks() == 4
    assert trace_format(path) == "mooncake"
    persisting = write_trace(generate_trace(TraceSpec(requests=3)), tmp_path / "p.jsonl")
    assert trace_format(persisting) == "persisting"


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ('{"timestamp": 1, "hash_ids": [1, 2', "not JSON"),
        ('{"timestamp": 1, "input_length": 3}', "not a Mooncake record"),
        ('{"id": "r1", "t": 0.5, "tokens": [1, 2]}', "persisting-trace line"),
        ("[1, 2, 3]", "must be a JSON object"),
        ('{"timestamp": 1, "hash_ids": [1, -2]}', "'hash_ids' must be a list of integers >= 0"),
        ('{"timestamp": 1, "hash_ids": [1, true]}', "'hash_ids' must be a list of integers"),
        ('{"timestamp": -5, "hash_ids": [1]}', "'timestamp' must be a number"),
        ('{"hash_ids": [1]}', "'timestamp' must be a number"),
        ('{"timestamp": 1, "hash_ids": [1], "input_length": "9"}', "'input_length'"),
    ],
)
def test_a_damaged_or_unknown_line_is_named(tmp_path: Path, bad: str, says: str) -> None:
    path = write(tmp_path / "t.jsonl", [json.dumps(RECORDS[0]), "", bad, json.dumps(RECORDS[1])])
    with pytest.raises(InvalidValueError) as caught:
        read_mooncake(path)
    assert f"{path}:3:" in str(caught.value)  # blank line 2 is skipped, still counted
    assert says in str(caught.value)


def test_empty_and_unreadable_traces(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match="empty trace"):
        read_mooncake(write(tmp_path / "e.jsonl", ["", "  "]))
    (tmp_path / "b.jsonl").write_bytes(b'{"timestamp": 0, "hash_ids": [1]}\n\xff\xfe\n')
    with pytest.raises(InvalidValueError, match="not UTF-8"):
        read_mooncake(tmp_path / "b.jsonl")
    with pytest.raises(InvalidValueError, match="neither"):
        trace_format(write(tmp_path / "x.jsonl", ['{"foo": 1}']))


def test_the_command_line_names_the_line_in_one_clear_error(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [json.dumps(RECORDS[0]), '{"timestamp": 2, "hash_ids": 7}'])
    result = CliRunner().invoke(
        app, ["bench", "replay", str(path), "--format", "mooncake", "--memory-bytes", "1MiB"]
    )
    assert result.exit_code == 2, result.output
    said = "".join(result.output.split())  # Rich may wrap the long path
    assert f"{path}:2:'hash_ids'mustbealist".replace(" ", "") in said
    assert "Traceback" not in result.output
