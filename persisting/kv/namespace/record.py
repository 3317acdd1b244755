"""What a namespace holds, in words: ``namespace.json`` in its directory.

A namespace's directory name is the model's name (or, for an engine, a digest of
everything that makes its KV incompatible), which tells an operator little. The store
writes this record when it opens: the model, the capacity the writer configured, and what
the opener says about its KV (engine, dtype, block size, layout, the weights' identity).
``persisting inspect`` and ``stats`` read it; nothing else does, and a damaged or missing
record costs only the description, never data.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persisting.errors import ConfigError
from persisting.lance_store.access import OWNER_ONLY, FileModes, open_private

log = logging.getLogger(__name__)

FILE_NAME = "namespace.json"
#: A description larger than this is refused (it is one small file, read by every report).
MAX_BYTES = 16 << 10


@dataclass(frozen=True)
class NamespaceRecord:
    """A namespace's model, the disk capacity its last writer configured, and what the
    opener said about its KV."""

    model: str
    capacity: int
    describe: dict[str, Any] = field(default_factory=dict)
    opened_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "capacity": self.capacity,
            "describe": self.describe,
            "opened_at": self.opened_at,
        }


def read_record(directory: Path) -> NamespaceRecord | None:
    """The record in ``directory``, or None if there is none or it is unreadable."""
    try:
        raw = json.loads((directory / FILE_NAME).read_text())
        return NamespaceRecord(
            str(raw["model"]),
            int(raw["capacity"]),
            dict(raw.get("describe") or {}),
            float(raw.get("opened_at") or 0.0),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(
    directory: Path,
    model: str,
    capacity: int,
    describe: Mapping[str, Any] | None,
    modes: FileModes = OWNER_ONLY,
) -> NamespaceRecord:
    """Record an opening of ``directory`` (a description left out keeps the last one):
    written beside, then renamed over the old record, so a reader sees one whole."""
    previous = read_record(directory)
    details = dict(describe) if describe is not None else {}
    if describe is None and previous is not None:
        details = previous.describe
    record = NamespaceRecord(model, capacity, details, time.time())
    try:
        body = json.dumps(record.to_dict()).encode()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a namespace description must be JSON: {exc}") from exc
    if len(body) > MAX_BYTES:
        raise ConfigError(f"a namespace description must be under {MAX_BYTES} bytes")
    tmp = directory / f".{FILE_NAME}.{os.getpid()}.tmp"
    try:
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, modes.file)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, directory / FILE_NAME)
    except OSError as exc:  # only the description is lost
        log.warning("cannot record the namespace of %s: %s", directory, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return record


__all__ = ["FILE_NAME", "NamespaceRecord", "read_record", "write_record"]
