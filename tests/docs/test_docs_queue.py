"""docs/queue.md runs as written: its Python blocks run in order in one working directory,
each in a fresh interpreter, and print what the page says they print."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from persisting.queue.positions import ConsumerPositions
from tests.docs.docs_helpers import REPO, RUN_LANGUAGES, fenced_blocks, run_block, run_env
from tests.timing import HANG_S

PAGE = REPO / "docs" / "queue.md"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_queue_page_runs_in_order(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    blocks = [
        b for b in fenced_blocks(PAGE.read_text()) if b.language in RUN_LANGUAGES and not b.marker
    ]
    assert len(blocks) == 3, [b.where() for b in blocks]
    writer, query, consumer = blocks
    assert "kv-events" not in writer.code + query.code + consumer.code  # the server's topic

    # Interpreter start, an actor system and 4 buckets opened, 5.5 s of waiting at most:
    # far inside the bound, which only a wait that never ends reaches.
    lines = run_block(writer, work, run_env(), timeout_s=HANG_S).splitlines()
    assert ast.literal_eval(lines[-2]) == ["req-1", "req-2"]
    assert lines[-1] == "[]"

    rows = [line.split(" ", 1) for line in run_block(query, work, run_env(), 60).splitlines()]
    found = [row for _bucket, table in rows for row in ast.literal_eval(table)]
    assert found == [{"_offset": 0, "id": "req-1"}]

    polled = run_block(consumer, work, run_env(), timeout_s=60).splitlines()
    ids = sorted(i for line in polled for _o, i in ast.literal_eval(line.split(" ", 1)[1]))
    assert ids == ["req-1", "req-2"]
    # Committed: a second run finds nothing new.
    assert run_block(consumer, work, run_env(), timeout_s=60).strip() == ""
    topic = work / "persisting-data" / "queue" / "queue-doc"
    committed = [ConsumerPositions(b).get("audit") for b in topic.glob("bucket_*")]
    assert sum(p or 0 for p in committed) == 2
