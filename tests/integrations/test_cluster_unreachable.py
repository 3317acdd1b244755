"""An engine's store of a cluster that does not answer (``open_engine_store``, as every
engine but LMCache opens it): it opens at once, every read is a
miss, every write fails and nothing is present, none of it an exception; it is tried again
later, in the background."""

from __future__ import annotations

import socket

from persisting.integrations.common import EngineSettings, open_engine_store
from persisting.integrations.common.cluster import Reconnecting
from persisting.integrations.vllm.namespace import block_key
from tests.timing import wait_until

NAMESPACE = "vllm.x.0123456789abcdef"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_a_cluster_that_does_not_answer_is_misses_never_an_error() -> None:
    seed = f"127.0.0.1:{_closed_port()}"
    settings = EngineSettings.model_validate({"cluster": {"seeds": [seed]}})
    store = open_engine_store(settings, NAMESPACE, reconnect=True)
    try:
        assert isinstance(store, Reconnecting) and not store.connected
        keys = [block_key(NAMESPACE, bytes([i]) * 32, 0, "bfloat16") for i in (1, 2)]
        assert store.read_into(keys, [bytearray(16), bytearray(16)]) == ["miss", "miss"]
        assert store.write_from(keys, [b"a" * 16, b"b" * 16]) == ["failed", "failed"]
        assert store.exists(keys) == [False, False]
        assert store.leading(keys) == 0 and store.remove(keys) == 0
        store.retry_s = 0.0  # the next question starts a try in the background
        assert store.exists(keys) == [False, False]
        wait_until(lambda: store._trying is None, "the background try to end")
        assert not store.connected
    finally:
        store.close()
