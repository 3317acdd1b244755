"""One owner per served namespace: a claim is exclusive across processes and within one,
names its holder when refused, lets go on release or when its process dies (even by
SIGKILL), and leaves a record tools read afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from persisting.errors import NamespaceInUseError, NamespaceOwnedError, StorageIOError
from persisting.lance_store import StorageRoot
from persisting.lance_store.ownership import is_claimed
from tests import child_env
from tests.timing import wait_until

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


# -- a lock that can be pulled (issue 39, item 4) ----------------------------------------

WATCHER = """
import sys
from persisting.lance_store import StorageRoot
claim = StorageRoot(sys.argv[1]).claim_model("org/model", "server", "a watched holder")
def lost(message):
    print("lost:", message, flush=True)
claim.watch(lost, every_s=0.05)
print("claimed", flush=True)
sys.stdin.readline()
"""


def lock_file(root: Path) -> Path:
    return StorageRoot(root).model_claim_dir(MODEL) / ".owner.lock"


def test_a_holder_whose_lock_file_was_removed_locks_a_new_one_and_a_second_claim_is_refused(
    root: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(root)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        path = lock_file(root)
        before = path.stat().st_ino
        path.unlink()  # rm .owner.lock under a live holder
        wait_until(lambda: path.exists() and is_claimed(path.parent), "the holder's new lock")
        assert path.stat().st_ino != before
        with pytest.raises(NamespaceOwnedError, match=f"pid {holder.pid} "):
            StorageRoot(root).claim_model(MODEL, "server", "a second server")
        assert holder.poll() is None  # still holding, nothing lost
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_holder_whose_lock_was_taken_by_another_process_is_told_it_lost_it(
    root: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(root)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        holder.send_signal(signal.SIGSTOP)  # it cannot lock a new file before we do
        lock_file(root).unlink()
        second = StorageRoot(root).claim_model(MODEL, "server", "the second holder")
        holder.send_signal(signal.SIGCONT)
        line = holder.stdout.readline()
        assert line.startswith("lost: the owner lock ") and str(lock_file(root)) in line
        assert f"pid {os.getpid()} " in line and "no longer owns it" in line
        owner = StorageRoot(root).model_owner(MODEL)
        assert owner is not None and owner.live and owner.pid == os.getpid()
        second.release()
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=30)


STALE = """
import os, sys
from persisting.errors import StorageIOError
from persisting.lance_store import StorageRoot
os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))  # after the imports: ours to read
try:
    StorageRoot(sys.argv[1]).claim_model("org/model", "server", "me")
except StorageIOError as exc:
    print(exc)
"""


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A storage root another user can reach (pytest's own temporary folders are private)."""
    base = Path(tempfile.mkdtemp(prefix="persisting-owner-"))
    os.chmod(base, 0o755)
    try:
        yield base / "root"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_stale_lock_of_another_user_is_named_with_its_owner(open_root: Path) -> None:
    """A lock file this user may not open: the refusal names the file and who owns it, not
    an unwritable root. As root, the claimant is a child running as another user (the lock
    file stays root's); otherwise the lock file is this user's own, made unreadable."""
    root = open_root
    storage = StorageRoot(root)
    storage.claim_model(MODEL, "server", "an old server").release()
    path = lock_file(root)
    if os.geteuid() == 0:
        user = 65534  # nobody
        for dirpath, _dirs, files in os.walk(root):
            os.chown(dirpath, user, user)
            for name in files:
                if name != ".owner.lock":
                    os.chown(Path(dirpath) / name, user, user)
        result = subprocess.run(
            [sys.executable, "-c", STALE, str(root), str(user)],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        message = result.stdout.strip()
        assert "belongs to root (uid 0), not to " in message, result.stderr
    else:
        os.chmod(path, 0)
        with pytest.raises(StorageIOError) as refused:
            storage.claim_model(MODEL, "server", "me")
        message = str(refused.value)
        assert f"uid {os.geteuid()})" in message
    assert f"cannot open the owner lock {path}:" in message and "mode 0" in message
    assert "is the storage root writable" not in message and "\n" not in message
