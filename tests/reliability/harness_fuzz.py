"""Hostile input, fuzzed with hypothesis: every call gets a typed PersistingError or a clean
miss, and the store keeps serving what it held before.

    python -m tests.reliability.harness_fuzz [--examples 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from persisting.errors import PersistingError
from persisting.kv import open_kv_store
from persisting.lance_store import StorageRoot
from tests.reliability.rel_common import MODEL, emit, key_text, value

HOSTILE_TEXT = st.one_of(
    st.text(max_size=300),
    st.sampled_from(
        [
            "",
            ".",
            "..",
            "../x",
            "/etc/passwd",
            "a\x00b",
            "a/../../b",
            "@",
            "%",
            "x" * 5000,
            f"{MODEL}@1@0@ff@half@\x00",
            f"{MODEL}@1@0@ff@half@a%b@",
            f"{MODEL}@-1@0@1@half",
            f"{MODEL}@1@0@1@half@" + "t%v@" * 300,
        ]
    ),
    st.builds(
        lambda h, d, extra: f"{MODEL}@1@0@{h}@{d}{extra}",
        st.text(alphabet="0123456789abcdefxyz-+", max_size=20),
        st.sampled_from(["half", "bfloat16", "float", "fp8", "", "HALF"]),
        st.sampled_from(["", "@1", "@x", "@a%b", "@%", "@0@a%b"]),
    ),
)

DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.int8,
    np.uint8,
    np.int64,
    np.bool_,
    np.complex64,
    np.uint32,
    np.object_,
]
FORMATS = ["KV_2LTD", "KV_2TD", "KV_T2D", "KV_MLA_FMT", "binary", "BINARY", "", "kv_2ltd", None]


def _values() -> st.SearchStrategy:
    shapes = st.lists(st.integers(0, 6), min_size=0, max_size=5)
    arrays = st.builds(lambda shape, dt: np.zeros(shape, dtype=dt), shapes, st.sampled_from(DTYPES))
    tensors = st.builds(
        lambda shape, dt, t: (
            torch.zeros(shape, dtype=dt).transpose(0, -1)
            if t and len(shape) > 1
            else torch.zeros(shape, dtype=dt)
        ),
        shapes,
        st.sampled_from(
            [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.complex64, torch.bool]
        ),
        st.booleans(),
    )
    others = st.one_of(
        st.binary(max_size=64),
        st.none(),
        st.integers(),
        st.text(max_size=10),
        st.lists(st.integers(), max_size=4),
        st.just(np.zeros((2, 1 << 21), np.int8)),
    )
    return st.one_of(arrays, tensors, others)


def run(examples: int, seed: int) -> dict:
    outcomes: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = open_kv_store(
            root, MODEL, memory_bytes=1 << 20, disk_bytes=4 << 20, max_value_bytes=2 << 20
        )
        store.put(key_text(1), value(1), fmt="KV_2TD")
        cfg = settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )

        def record(call) -> None:
            try:
                result = call()
            except PersistingError as exc:
                outcomes[f"typed:{type(exc).__name__}"] += 1
                return
            outcomes["miss" if result in (None, False, 0) else "accepted"] += 1

        @cfg
        @hypothesis_seed(seed)
        @given(HOSTILE_TEXT)
        def hostile_keys(text: str) -> None:
            outcomes["inputs"] += 1
            record(lambda: store.get(text))
            record(lambda: store.contains(text))
            record(lambda: store.lookup_prefix([text]))
            record(lambda: store.remove(text))

        @cfg
        @hypothesis_seed(seed)
        @given(HOSTILE_TEXT)
        def hostile_names(name: str) -> None:
            outcomes["inputs"] += 1
            record(lambda: StorageRoot(root).kv_path(name).relative_to(root))
            record(lambda: StorageRoot(root).queue_path(name, 0).relative_to(root))

        @cfg
        @hypothesis_seed(seed)
        @given(_values(), st.sampled_from(FORMATS))
        def hostile_values(val, fmt) -> None:
            outcomes["inputs"] += 1
            record(lambda: store.put(key_text(2), val, fmt=fmt))
            store.remove(key_text(2))

        for fn in (hostile_keys, hostile_names, hostile_values):
            fn()
        intact = np.array_equal(store.get(key_text(1)), value(1))
        store.close()
        with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=4 << 20) as again:
            intact = intact and np.array_equal(again.get(key_text(1)), value(1))
        escaped = [p for p in root.rglob("*") if root not in p.resolve().parents]
    return {
        "harness": "fuzz",
        "inputs_fuzzed": outcomes.pop("inputs"),
        "calls": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "untyped_errors": 0,  # any other exception propagates and fails the harness
        "stored_data_intact": bool(intact),
        "paths_outside_root": len(escaped),
        "seed": seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.examples, args.seed)
    emit(result, args.json)
    sys.exit(0 if result["stored_data_intact"] and not result["paths_outside_root"] else 1)


if __name__ == "__main__":
    main()
