"""Shared pieces of the reliability harnesses: deterministic values, keys, JSON output."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "reliability/model"


def key_text(i: int, worker: int = 0, world: int = 1) -> str:
    return f"{MODEL}@{world}@{worker}@{i * 2654435761 - (1 << 40):x}@half"


def value(i: int, max_kib: int = 1024) -> np.ndarray:
    """A value whose every byte depends on ``i``; sizes vary from 4 KiB to ``max_kib`` KiB."""
    rng = np.random.default_rng(i)
    n = int(rng.integers(1, max_kib // 4 + 1)) * 2048
    return rng.standard_normal(n).astype(np.float16).reshape(2, -1, 64)  # KV_2TD


def emit(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=True)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    sys.stdout.flush()
