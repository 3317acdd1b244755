"""One owner per served namespace: a claim is exclusive across processes and within one,
names its holder when refused, lets go on release or when its process dies (even by
SIGKILL), and leaves a record tools read afterwards."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from persisting.errors import NamespaceInUseError, NamespaceOwnedError
from persisting.lance_store import StorageRoot
from tests import child_env

MODEL = "org/model"

HOLDER = """
import sys
from persisting.lance_store import StorageRoot
claim = StorageRoot(sys.argv[1]).claim_model(
    "org/model", "server", "a test holder", {"capacity": 1234}
)
print("claimed", flush=True)
sys.stdin.readline()
"""


def test_a_second_claim_is_refused_naming_the_holder_until_the_first_lets_go(
    root: Path,
) -> None:
    storage = StorageRoot(root)
    claim = storage.claim_model(MODEL, "server", "persisting server 'kv' on 127.0.0.1:1")
    with pytest.raises(NamespaceOwnedError) as refused:
        storage.claim_model(MODEL, "l2-adapter", "another")
    message = str(refused.value)
    assert "model 'org/model'" in message and "is already held by pid" in message
    assert "persisting server 'kv' on 127.0.0.1:1" in message and "\n" not in message
    assert isinstance(refused.value, NamespaceInUseError)  # one family with drop's refusal
    owner = storage.model_owner(MODEL)
    assert owner is not None and owner.live and owner.role == "server"
    claim.update("persisting server 'kv' on 127.0.0.1:2", addr="127.0.0.1:2")
    assert storage.model_owner(MODEL).details["addr"] == "127.0.0.1:2"  # type: ignore[union-attr]
    claim.release()
    owner = storage.model_owner(MODEL)
    assert owner is not None and not owner.live  # the record stays, not live
    again = storage.claim_model(MODEL, "l2-adapter", "an adapter", {"capacity": 7})
    assert storage.model_owner(MODEL).details == {"capacity": 7}  # type: ignore[union-attr]
    again.release()


def test_claims_are_per_namespace_and_per_consumer(root: Path) -> None:
    storage = StorageRoot(root)
    a = storage.claim_model("org/a", "server", "a")
    b = storage.claim_model("org/b", "server", "b")  # another namespace: no conflict
    first = storage.claim_consumer("kv-events", "kv-service/kvstore", "consumer 1")
    other = storage.claim_consumer("kv-events", "kv-service/other", "consumer 2")
    with pytest.raises(NamespaceOwnedError, match="--no-events, or another --name"):
        storage.claim_consumer("kv-events", "kv-service/kvstore", "consumer 3")
    assert [h.what for h in storage.consumer_owners("kv-events")] == ["consumer 1", "consumer 2"]
    # Claims live beside the namespaces: not models, not in a namespace's byte budget.
    assert storage.list_models() == []
    storage.make_kv_dir("org/a")
    assert storage.list_models() == ["org/a"]
    assert not any(p.name.startswith(".owner") for p in storage.kv_path("org/a").iterdir())
    for claim in (a, b, first, other):
        claim.release()


def test_a_killed_holder_lets_go(root: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        storage = StorageRoot(root)
        with pytest.raises(NamespaceOwnedError, match=f"pid {holder.pid} "):
            storage.claim_model(MODEL, "server", "me")
        owner = storage.model_owner(MODEL)
        assert owner is not None and owner.pid == holder.pid and owner.details["capacity"] == 1234
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert not storage.model_owner(MODEL).live  # type: ignore[union-attr]
        storage.claim_model(MODEL, "server", "me").release()
    finally:
        holder.kill()
        holder.wait(timeout=30)
