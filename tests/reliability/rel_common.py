"""Shared pieces of the reliability harnesses: deterministic values, keys, JSON output."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests import child_env

MODEL = "reliability/model"


def key_text(i: int, worker: int = 0, world: int = 1) -> str:
    return f"{MODEL}@{world}@{worker}@{i * 2654435761 - (1 << 40):x}@half"


def value(i: int, max_kib: int = 1024) -> np.ndarray:
    """A value whose every byte depends on ``i``; sizes vary from 4 KiB to ``max_kib`` KiB."""
    rng = np.random.default_rng(i)
    n = int(rng.integers(1, max_kib // 4 + 1)) * 2048
    return rng.standard_normal(n).astype(np.float16).reshape(2, -1, 64)  # KV_2TD


def run_and_kill(args: list[str], delay_s: float) -> list[int]:
    """Start a writer that prints ``ready`` and then one acknowledged number per line,
    SIGKILL it ``delay_s`` seconds later, and return every number it acknowledged."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout])  # type: ignore[union-attr]
    reader.start()
    time.sleep(delay_s)  # real duration: the kill lands at a chosen point of the writing
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    reader.join(30)  # what was printed before the kill was acknowledged before it
    acked = []
    while not lines.empty():
        acked.append(int(lines.get()))
    return acked


def emit(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=True)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    sys.stdout.flush()
