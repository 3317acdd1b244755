"""The storage root shared by the queue and the KV store, and its path layout.

::

    <root>/queue/<topic>/bucket_<id>/data.lance   queue records
    <root>/kv/<model>/...                         KV chunks of one model

``<topic>`` and ``<model>`` are encoded by :mod:`persisting.lance_store.names`, so every
name lands in exactly one directory directly under its parent, and distinct names never
share one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa

from persisting.errors import InvalidNameError, StorageIOError
from persisting.lance_store.access import (
    FileModes,
    check_private,
    file_modes,
    make_dir,
    restrict,
)
from persisting.lance_store.durable import fsync_dir, makedirs_durable
from persisting.lance_store.names import decode_name, encode_name
from persisting.lance_store.namespace_lock import (
    NamespaceHold,
    exclusive_namespace,
    hold_namespace,
)
from persisting.lance_store.ownership import Holder, OwnerClaim, claim_owner, read_owner
from persisting.lance_store.root_keys import RootKeys
from persisting.lance_store.table import LanceTable, disk_usage

QUEUE_DIR = "queue"
KV_DIR = "kv"
QUEUE_DATASET = "data.lance"
#: Under a topic's directory: one directory per consumer holding its claim (see
#: :mod:`persisting.lance_store.ownership`).
CONSUMER_CLAIMS_DIR = ".consumers"
#: Under ``kv/``: one directory per model holding the claim of the process serving it.
OWNER_CLAIMS_DIR = ".owners"


class StorageRoot:
    """A Persisting storage root on the local filesystem.

    ``access`` says who may read what is written under it (see
    :mod:`persisting.lance_store.access`): ``"owner"`` (the default) or ``"group"``.
    """

    def __init__(self, root: str | os.PathLike[str], access: str | FileModes | None = None):
        self.root = Path(root).expanduser().absolute()
        self.modes = file_modes(access)

    def __repr__(self) -> str:
        return f"StorageRoot({str(self.root)!r})"

    # -- layout -------------------------------------------------------------------------

    def topic_dir(self, topic: str) -> Path:
        return self.root / QUEUE_DIR / encode_name(topic, "topic")

    def queue_bucket_dir(self, topic: str, bucket_id: int) -> Path:
        """``<root>/queue/<topic>/bucket_<id>``: what Pulsing calls a bucket's storage_path."""
        return self.topic_dir(topic) / f"bucket_{_bucket_number(bucket_id)}"

    def queue_path(self, topic: str, bucket_id: int) -> Path:
        """The Lance dataset holding one queue bucket's records."""
        return self.queue_bucket_dir(topic, bucket_id) / QUEUE_DATASET

    def kv_path(self, model: str) -> Path:
        """The directory holding one model's KV chunks."""
        return self.root / KV_DIR / encode_name(model, "model")

    def make_kv_dir(self, model: str) -> Path:
        """Create (or tighten) ``<root>/kv/<model>`` and return it: the root if missing,
        ``kv/`` and the model's directory with this root's directory mode. Each must be
        this user's and writable by nobody else (:func:`~persisting.lance_store.access.
        check_private`): an UnsafeStorageError says which and how to fix it."""
        path = self.kv_path(model)
        self.make_private_root()
        make_dir(self.root / KV_DIR, self.modes)
        check_private(self.root / KV_DIR, "the KV directory")
        make_dir(path, self.modes)
        check_private(path, f"the namespace directory of {model!r}")
        return path

    def make_private_root(self) -> None:
        """Create the root if missing (or tighten ours) and refuse it if it is not this
        user's alone to write."""
        makedirs_durable(self.root, self.modes)
        real = self.root.resolve()
        restrict(real, self.modes.directory)
        check_private(real, "storage root")

    def kv_keys(self) -> RootKeys:
        """The keys that seal what the root's stores write (see
        :mod:`~persisting.lance_store.root_keys`): the current one made on first use. A
        payload file whose header is sealed with none of them was not written by a store of
        this root, and is never served (:mod:`persisting.kv.disk.payload_files`)."""
        self.make_private_root()
        make_dir(self.root / KV_DIR, self.modes)
        check_private(self.root / KV_DIR, "the KV directory")
        return RootKeys(self.root / KV_DIR)

    def hold_model(self, model: str) -> NamespaceHold:
        """Open ``model``'s namespace for a store: its directory exists and stays (a drop
        refuses) until the returned hold is released."""
        path = self.kv_path(model)
        return hold_namespace(path, lambda: self.make_kv_dir(model))

    def claim_model(
        self, model: str, role: str, what: str, details: Mapping[str, object] | None = None
    ) -> OwnerClaim:
        """Claim ``model``'s namespace for a serving role (a server, an L2 adapter): refused
        with NamespaceOwnedError, naming the holder, while a live process holds it."""
        path = self.model_claim_dir(model)
        return claim_owner(
            path,
            role=role,
            what=what,
            subject=f"model {model!r} under {self.root}",
            details=details,
            make_dir=lambda: makedirs_durable(path, self.modes),
        )

    def model_claim_dir(self, model: str) -> Path:
        """``<root>/kv/.owners/<model>``: where the claim on a model's namespace lives --
        beside the namespace, not in it, so it neither counts against the namespace's disk
        budget nor goes with a drop."""
        return self.root / KV_DIR / OWNER_CLAIMS_DIR / encode_name(model, "model")

    def model_owner(self, model: str) -> Holder | None:
        """Who claimed ``model``'s namespace (``live`` if it still holds it), or None."""
        return read_owner(self.model_claim_dir(model))

    def consumer_dir(self, topic: str, consumer: str) -> Path:
        """``<root>/queue/<topic>/.consumers/<consumer>``: where a consumer's claim lives."""
        return self.topic_dir(topic) / CONSUMER_CLAIMS_DIR / encode_name(consumer, "consumer")

    def claim_consumer(
        self, topic: str, consumer: str, what: str, details: Mapping[str, object] | None = None
    ) -> OwnerClaim:
        """Claim the consumer ``consumer`` of ``topic``: one live process runs it."""
        path = self.consumer_dir(topic, consumer)
        return claim_owner(
            path,
            role="event-consumer",
            what=what,
            subject=f"consumer {consumer!r} of topic {topic!r} under {self.root}",
            details=details,
            advice="one process runs a consumer (serve with --no-events, or another --name)",
            make_dir=lambda: makedirs_durable(path, self.modes),
        )

    def consumer_owners(self, topic: str) -> list[Holder]:
        """The recorded holders of ``topic``'s consumer claims (live or not)."""
        base = self.topic_dir(topic) / CONSUMER_CLAIMS_DIR
        try:
            entries = sorted(os.listdir(base))
        except FileNotFoundError:
            return []
        found = (read_owner(base / entry) for entry in entries)
        return [holder for holder in found if holder is not None]

    # -- namespaces ---------------------------------------------------------------------

    def list_models(self) -> list[str]:
        return _decoded_children(self.root / KV_DIR)

    def list_topics(self) -> list[str]:
        return _decoded_children(self.root / QUEUE_DIR)

    def drop_model(self, model: str) -> bool:
        """Remove a model's namespace whole; False if it did not exist.

        Raises :class:`~persisting.errors.NamespaceInUseError` (without waiting) while a
        live store, in any process, has the model open.
        """
        path = self.kv_path(model)
        with exclusive_namespace(path, f"model {model!r}", holder=self._holder(model)) as exists:
            return _drop_tree(path) if exists else False

    def _holder(self, model: str) -> str | None:
        owner = self.model_owner(model)
        return owner.describe() if owner is not None and owner.live else None

    def drop_topic(self, topic: str) -> bool:
        return _drop_tree(self.topic_dir(topic))

    def model_bytes(self, model: str) -> int:
        path = self.kv_path(model)
        return disk_usage(path) if path.exists() else 0

    def list_buckets(self, topic: str) -> list[int]:
        """Ids of ``topic``'s bucket directories, ascending (other entries are skipped)."""
        try:
            entries = os.listdir(self.topic_dir(topic))
        except FileNotFoundError:
            return []
        ids: list[int] = []
        for entry in entries:
            number = entry.removeprefix("bucket_")
            # Only the spelling queue_bucket_dir makes: "bucket_7", never "bucket_07".
            if number.isascii() and number.isdigit() and f"bucket_{int(number)}" == entry:
                ids.append(int(number))
        return sorted(ids)

    # -- datasets -----------------------------------------------------------------------

    def open_table(self, path: str | os.PathLike[str], schema: pa.Schema) -> LanceTable:
        """Open (or create) the dataset at ``path``, which must lie under the root."""
        resolved = Path(path).absolute()
        if self.root != resolved and self.root not in resolved.parents:
            raise InvalidNameError(f"{resolved} is outside the storage root {self.root}")
        return LanceTable(resolved, schema)

    def existing_table(self, path: str | os.PathLike[str]) -> LanceTable | None:
        """Open the dataset at ``path`` as it is, or None if there is none: never creates one
        and never changes its schema (for tools that only read or maintain datasets)."""
        resolved = Path(path).absolute()
        if not (resolved / "_versions").is_dir():
            return None
        return self.open_table(resolved, pa.schema([]))


def _bucket_number(bucket_id: object) -> int:
    if isinstance(bucket_id, bool) or not isinstance(bucket_id, int) or bucket_id < 0:
        raise InvalidNameError(f"bucket id must be a non-negative integer, got {bucket_id!r}")
    return bucket_id


def _decoded_children(directory: Path) -> list[str]:
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    names: list[str] = []
    for entry in entries:
        try:
            names.append(decode_name(entry))
        except InvalidNameError:
            continue  # not a directory we made
    return names


def _drop_tree(path: Path) -> bool:
    if not path.exists():
        return False
    # Rename first so a crash mid-delete never leaves a half-dropped live namespace.
    graveyard = path.with_name(f".dropping-{path.name}-{os.getpid()}")
    try:
        os.rename(path, graveyard)
        fsync_dir(path.parent)
        shutil.rmtree(graveyard)
    except OSError as exc:
        raise StorageIOError(f"cannot drop {path}: {exc}") from exc
    return True


__all__ = ["KV_DIR", "QUEUE_DATASET", "QUEUE_DIR", "StorageRoot"]
