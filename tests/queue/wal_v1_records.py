"""The records in ``data/wal_v1/``: a log segment written by the tagged codec the log used
before msgpack (segment magic ``PQWAL001``, commit 92e857a). A bucket upgraded with such a
log must replay it exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def v1_records() -> list[dict[str, Any]]:
    return [
        {"id": "k0", "seq": 0, "score": 0.25, "ok": True, "note": None},
        {"id": "ünï∑", "seq": -(2**63), "score": -1.5e300, "ok": False, "raw": b"\x00\xff"},
        {"id": "k2", "seq": 2**63 - 1, "tags": ["a", "b"], "nested": {"a.b": {"c": [1, 2]}}},
        {"id": "k3", "emb": np.arange(6, dtype=">u2").reshape(2, 3), "one": np.float32(0.5)},
        {"id": "k4", "kv": torch.arange(8, dtype=torch.bfloat16).reshape(2, 4), "empty": []},
        {"id": "k5", "mixed": [1, 2.5], "when": np.array(["2024-01-02"], dtype="datetime64[D]")},
    ]
