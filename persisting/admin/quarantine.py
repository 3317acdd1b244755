"""``persisting quarantine``: what a namespace set aside, adding a key, deleting it.

A store moves the payload files it cannot verify into ``<namespace>/quarantine/``
(:mod:`persisting.kv.disk.quarantine`) and never deletes them: one whose root key was lost or
left behind by a copy comes back at the next open once its key is among the root's
(``--add-key``), and only the operator deletes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from persisting.errors import ConfigError
from persisting.kv.disk.quarantine import Quarantine
from persisting.lance_store import StorageRoot
from persisting.lance_store.root_keys import SECRET_BYTES, RootKeys


@dataclass
class QuarantineReport:
    model: str
    path: Path
    files: int
    bytes: int
    #: Set by ``--add-key``: the id of the key added to the root.
    added_key: str | None = None
    #: Set by ``--delete``: files and bytes deleted.
    deleted_files: int = 0
    deleted_bytes: int = 0


def quarantine_of(store: StorageRoot, model: str) -> QuarantineReport:
    """What ``model``'s namespace holds aside, changing nothing."""
    path = store.kv_path(model)
    files, nbytes = Quarantine(path, store.modes).summary()
    return QuarantineReport(model, path / "quarantine", files, nbytes)


def add_root_key(store: StorageRoot, key_file: Path) -> str:
    """Make the key in ``key_file`` (another root's ``kv/.secret``, or a file of its
    ``kv/.keys/``) a key of ``store``: the files sealed with it come back at the next open."""
    try:
        key = key_file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {key_file}: {exc.strerror}") from None
    if len(key) != SECRET_BYTES:
        raise ConfigError(f"{key_file} is not a Persisting root key ({len(key)} bytes)")
    return RootKeys(store.root / "kv").add(key).id


def delete_quarantined(store: StorageRoot, model: str) -> tuple[int, int]:
    """Delete what ``model``'s namespace holds aside: ``(files, bytes)``."""
    return Quarantine(store.kv_path(model), store.modes).delete_all()


__all__ = ["QuarantineReport", "add_root_key", "delete_quarantined", "quarantine_of"]
