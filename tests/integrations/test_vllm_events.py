"""Prewarm/evict events reach a vLLM namespace: the connector's follower reads the root's
event topic (as ``persisting prewarm`` writes it) and applies the namespace's events.

The follower is what each engine's scheduler runs with ``event_topic`` set; here it runs
over the namespace's real store and a real Lance queue topic, without an engine (an engine
sees a removed block as gone at its next rescan, which tests/engines/ covers with damaged
blocks).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from actors.kv_events import publish_events
from persisting.config import PersistingSettings
from persisting.integrations.vllm.events import EventFollower
from persisting.integrations.vllm.namespace import block_key
from persisting.integrations.vllm.settings import connector_settings
from persisting.integrations.vllm.shared import acquire, release
from persisting.kv import open_kv_store
from tests.timing import wait_until

NAMESPACE = "vllm.llama.0123456789abcdef"
TOPIC = "kv-events"


def test_evict_removes_the_blocks_and_prewarm_is_applied(tmp_path: Path) -> None:
    root = tmp_path / "root"
    keys = [block_key(NAMESPACE, bytes([i]) * 32, 0, "bfloat16") for i in range(3)]
    with open_kv_store(root, NAMESPACE, memory_bytes=0, disk_bytes=64 << 20) as store:
        store.batched_put(keys, [np.full((2, 4096), i, np.uint8) for i in range(3)], fmt="binary")
    state = acquire(connector_settings({"storage_path": str(root)}), NAMESPACE)
    forgotten: list[str] = []
    follower = EventFollower(state, root, TOPIC, forgotten.extend, poll_s=0.05)
    try:
        settings = PersistingSettings(storage_path=root)
        events = [
            {"op": "prewarm", "model": NAMESPACE, "keys": keys[:2]},
            {"op": "evict", "model": NAMESPACE, "keys": [keys[1]]},
            {"op": "evict", "model": "another-model", "keys": ["another-model@1@0@ab@bfloat16"]},
            {"op": "prewarm", "model": NAMESPACE, "tokens": [1, 2, 3], "chunk_size": 2},
        ]
        asyncio.run(publish_events(settings, events, topic=TOPIC))
        wait_until(
            lambda: follower.applied["evict"] == 1 and follower.applied["skipped"] == 1,
            "the evict applied and the foreign event skipped",
        )
        assert follower.applied["prewarm"] == 1
        assert forgotten == [keys[1]]
        assert state.counters.snapshot()["events_applied"] == 2
    finally:
        follower.stop()
        release(state)
    with open_kv_store(root, NAMESPACE, memory_bytes=0, disk_bytes=64 << 20) as store:
        assert [store.contains(k) for k in keys] == [True, False, True]
