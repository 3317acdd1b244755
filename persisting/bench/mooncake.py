"""Block traces: Mooncake's trace format, read as it is.

Mooncake's FAST'25 traces (``kvcache-ai/Mooncake``, ``FAST25-release/traces/``) give one
JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is milliseconds from the start; ``hash_ids`` are the prompt's blocks
(``block_tokens`` tokens each, 512 in the published traces), prefix-chained: two requests
share block ``i``'s id only if their first ``i + 1`` blocks are equal. A record here is
``len(hash_ids)`` whole blocks (the last one of a prompt may be partial in the workload;
counting it whole is the convention the published hit ratios use). Other fields are kept
out of the way and ignored; a line that is not JSON, not an object, or lacks a field this
needs is refused with its line number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from persisting.bench.trace import is_int
from persisting.errors import InvalidValueError

TraceFormat = Literal["persisting", "mooncake"]
#: Tokens per block of the published Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One prompt as its blocks' ids, arriving ``t`` seconds from the start."""

    t: float
    blocks: tuple[int, ...]
    input_length: int | None = None
    output_length: int | None = None
    #: The line of the trace file it came from.
    line: int = 0


@dataclass(frozen=True)
class BlockTrace:
    """Requests as prefix-chained block ids, in file order, ``block_tokens`` per block."""

    requests: tuple[BlockRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    source: str = ""

    @property
    def references(self) -> int:
        """Block references: the sum of the requests' lengths."""
        return sum(len(r.blocks) for r in self.requests)

    def distinct_blocks(self) -> int:
        return len({b for r in self.requests for b in r.blocks})

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t - self.requests[0].t if self.requests else 0.0


def trace_format(path: str | Path) -> TraceFormat:
    """Which format the JSONL trace at ``path`` is in, from its first non-empty line."""
    from persisting.bench.trace import TRACE_FORMAT

    path = Path(path)
    for lineno, obj in _json_lines(path):
        if isinstance(obj, dict) and obj.get("format") == TRACE_FORMAT:
            return "persisting"
        if isinstance(obj, dict) and "hash_ids" in obj:
            return "mooncake"
        raise InvalidValueError(
            f"{path}:{lineno}: neither a {TRACE_FORMAT!r} header nor a Mooncake record "
            "(an object with 'hash_ids'); give --format"
        )
    raise InvalidValueError(f"{path}: empty trace")


def read_mooncake(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> BlockTrace:
    """Read a Mooncake trace; InvalidValueError naming the line for any record it cannot use."""
    path = Path(path)
    if block_tokens < 1:
        raise InvalidValueError(f"block_tokens must be >= 1, got {block_tokens}").about(
            "block_tokens"
        )
    requests = [_record(obj, f"{path}:{lineno}", lineno) for lineno, obj in _json_lines(path)]
    if not requests:
        raise InvalidValueError(f"{path}: empty trace (no records)")
    return BlockTrace(tuple(requests), block_tokens, str(path))


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
    except OSError as exc:
        raise InvalidValueError(f"cannot read trace {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidValueError(f"{path}: not UTF-8 text ({exc.reason})") from exc


def _record(obj: Any, where: str, lineno: int) -> BlockRequest:
    if not isinstance(obj, dict):
        raise InvalidValueError(f"{where}: a record must be a JSON object")
    if "hash_ids" not in obj:
        known = "a persisting-trace line" if "segments" in obj or "tokens" in obj else "it"
        raise InvalidValueError(
            f"{where}: not a Mooncake record ({known} has no 'hash_ids'); fields: {sorted(obj)[:8]}"
        )
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(is_int(x) and x >= 0 for x in ids):
        raise InvalidValueError(f"{where}: 'hash_ids' must be a list of integers >= 0")
    t = obj.get("timestamp")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise InvalidValueError(f"{where}: 'timestamp' must be a number of milliseconds >= 0")
    lengths = []
    for name in ("input_length", "output_length"):
        value = obj.get(name)
        if value is not None and not (is_int(value) and value >= 0):
            raise InvalidValueError(f"{where}: {name!r} must be an integer >= 0")
        lengths.append(value)
    return BlockRequest(t / 1000.0, tuple(ids), lengths[0], lengths[1], lineno)


__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "BlockRequest",
    "BlockTrace",
    "TraceFormat",
    "read_mooncake",
    "trace_format",
]
