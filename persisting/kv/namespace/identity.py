"""Which weights a model's KV came from, for the names of namespaces.

KV computed by one set of weights is wrong KV for any other, and a model's *name* does not
tell weights apart: a fine-tune saved over the same directory, a new revision on a hub, a
checkpoint rebuilt under the same path all keep the name. So every namespace a model's KV
lives in also carries :func:`model_identity`, in this order of preference:

1. a version string the operator pins (``model_version``): taken as is, nothing is read;
2. a fingerprint of the model's files when the model is a local directory or a snapshot in
   the Hugging Face cache: each file's size and a content hash, cached by device, inode,
   size, mtime and ctime so a restart does not hash hundreds of GB again;
3. otherwise ``"unverified"``, with a warning: the name alone then names the namespace.

Docs, licences and images are left out of the fingerprint; every other file is in (the
config, the weights, quantization files, the tokenizer): a change to any of them opens a
new namespace -- a miss, never KV of other weights.

Where a name can lie, content decides. A snapshot's files are links to blobs named by the
hash their content had when downloaded, but writing through the link (what
``PretrainedConfig.to_json_file`` or ``save_pretrained`` into a snapshot do) changes the
blob and keeps its name. So every file up to ``_CONTENT_BYTES`` (configs, tokenizers,
generation and quantization settings, small weights) is hashed by its bytes wherever it
lives; a larger blob (a weights shard) is named by its blob name, its size and an xxh3 of
``_SAMPLES`` slices of ``_SAMPLE_BYTES`` spread over it (a re-saved fine-tune changes
every tensor, so every slice), which reads about 1 MiB per shard, not the shard. A
subdirectory that is a link is followed, at most ``_MAX_DEPTH`` levels deep and over at
most ``_MAX_FILES`` files in all; a link back to a directory on the walk's own path (a
loop) is skipped. A tree past either bound raises a ``ConfigError``: pin
``model_version`` for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from persisting.errors import ConfigError

log = logging.getLogger(__name__)

#: Files that cannot change a model's KV, left out of its fingerprint.
_IGNORED_SUFFIXES = (".md", ".txt", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".lock")
_IGNORED_NAMES = ("LICENSE", "LICENCE", "NOTICE", "USE_POLICY", "README")
#: Read size while hashing a file.
_READ_BYTES = 8 << 20
#: Snapshot files up to this size are hashed by content, not trusted by their blob's name.
_CONTENT_BYTES = 64 << 20
#: Slices (and their size) read from a larger blob beside its name.
_SAMPLES = 16
_SAMPLE_BYTES = 64 << 10
#: How deep, and over how many files, a model directory is walked (links followed).
_MAX_DEPTH = 16
_MAX_FILES = 100_000
_CACHE_LOCK = threading.Lock()


def model_identity(
    model: str, *, revision: str | None = None, version: str | None = None
) -> dict[str, str]:
    """Fields naming the weights behind ``model`` (a local directory or a hub id), to go
    into a namespace's digest: ``{"weights": ...}``, plus ``{"revision": ...}`` when one
    is given. ``version`` (the operator's pin) wins over reading the files."""
    fields: dict[str, str] = {}
    if revision:
        fields["revision"] = revision
    if version:
        fields["weights"] = f"version:{version}"
        return fields
    directory = _local_directory(model, revision)
    if directory is None:
        log.warning(
            "Persisting: cannot find the files of model %r to fingerprint its weights; KV is"
            " kept under its name only, so set model_version to the weights' version (a new"
            " version, a fine-tune or a re-quantization under the same name would otherwise"
            " read old KV)",
            model,
        )
        fields["weights"] = "unverified"
        return fields
    fields["weights"] = f"files:{fingerprint_directory(directory)}"
    return fields


def weights_namespace(model: str, version: str | None = None) -> tuple[str, dict[str, str]]:
    """The namespace ``model``'s KV goes to, and the fields naming its weights: the model's
    own name while its weights cannot be identified (no pinned ``version``, no files
    found: as before weights were named), else ``<model>#<12 hex digits>`` of their
    identity, so new weights under the same name open a new, empty namespace."""
    fields = model_identity(model, version=version)
    if fields["weights"] == "unverified":
        return model, fields
    text = json.dumps(fields, sort_keys=True)
    return f"{model}#{hashlib.sha256(text.encode()).hexdigest()[:12]}", fields


def _local_directory(model: str, revision: str | None) -> Path | None:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        return None  # a path that is not there: not a hub id either
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(
            model,
            revision=revision,
            local_files_only=True,
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,  # as set now, not at import
        )
    except Exception:  # not in the cache (or no valid hub id): nothing to fingerprint
        return None
    return Path(found)


def fingerprint_directory(directory: Path) -> str:
    """32 hex digits over every relevant file under ``directory``: its path, size and
    content hash (see the module docstring)."""
    entries = []
    cache = _FingerprintCache.load()
    for relative, path in _relevant_files(directory):
        info = path.stat()
        entries.append(f"{relative}\0{info.st_size}\0{_file_digest(path, info, cache)}")
    cache.save()
    text = "\n".join(sorted(entries))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _relevant_files(directory: Path) -> Iterator[tuple[str, Path]]:
    """Every relevant file under ``directory``, linked subdirectories followed (bounded by
    ``_MAX_DEPTH`` and ``_MAX_FILES``; a link to a directory on the current path, a loop,
    is skipped), by its path relative to ``directory``."""
    seen = 0

    def walk(
        path: Path, relative: str, depth: int, ancestors: frozenset[tuple[int, int]]
    ) -> Iterator[tuple[str, Path]]:
        nonlocal seen
        if depth > _MAX_DEPTH:
            raise ConfigError(
                f"model directory {directory} is more than {_MAX_DEPTH} directories deep"
                " (links followed): cannot fingerprint its weights; set model_version"
            )
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return  # unreadable: a link to nowhere, or a directory gone meanwhile
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue
            child = f"{relative}{name}"
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
                is_file = not is_dir and entry.is_file(follow_symlinks=True)
            except OSError:
                continue
            if is_dir:
                try:
                    info = entry.stat(follow_symlinks=True)
                except OSError:
                    continue
                here = (info.st_dev, info.st_ino)
                if here in ancestors:
                    continue  # a link back up the walk: a loop, nothing new below it
                yield from walk(Path(entry.path), f"{child}/", depth + 1, ancestors | {here})
            elif is_file:  # a dangling link is not part of the model
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name.split(".")[0].upper() in _IGNORED_NAMES:
                    continue
                seen += 1
                if seen > _MAX_FILES:
                    raise ConfigError(
                        f"model directory {directory} holds more than {_MAX_FILES} files"
                        " (links followed): cannot fingerprint its weights; set"
                        " model_version"
                    )
                yield child, Path(entry.path)

    root = directory.stat()
    yield from walk(directory, "", 0, frozenset({(root.st_dev, root.st_ino)}))


def _file_digest(path: Path, info: os.stat_result, cache: _FingerprintCache) -> str:
    """A file's content hash: xxh3-128 of its bytes, or for a hub blob over
    ``_CONTENT_BYTES`` its name, size and sampled slices (cached by the file's identity)."""
    blob = None
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        info = target.stat()
        path = target
        if target.parent.name == "blobs" and len(target.name) >= 40:
            blob = target.name
    stamp = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    big_blob = blob is not None and info.st_size > _CONTENT_BYTES
    key = f"sampled:{path}" if big_blob else str(path)
    known = cache.get(key, stamp)
    if known is not None:
        return known
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        if big_blob:
            step = (info.st_size - _SAMPLE_BYTES) // (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(i * step)
                digest.update(f.read(_SAMPLE_BYTES))
        else:
            while chunk := f.read(_READ_BYTES):
                digest.update(chunk)
    value = f"blob:{blob}:{digest.hexdigest()}" if big_blob else f"xxh3:{digest.hexdigest()}"
    cache.put(key, stamp, value)
    return value


class _FingerprintCache:
    """File digests by path and identity, in ``$XDG_CACHE_HOME/persisting`` (private to
    the user; a damaged or missing cache only costs a rehash)."""

    def __init__(self, path: Path, entries: dict[str, Any]):
        self.path = path
        self.entries = entries
        self.changed = False

    @classmethod
    def load(cls) -> _FingerprintCache:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path = base / "persisting" / "model-fingerprints.json"
        try:
            entries = json.loads(path.read_text())
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        return cls(path, entries)

    def get(self, key: str, stamp: list[int]) -> str | None:
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("stamp") == stamp:
            digest = entry.get("digest")
            return digest if isinstance(digest, str) else None
        return None

    def put(self, key: str, stamp: list[int], digest: str) -> None:
        self.entries[key] = {"stamp": stamp, "digest": digest}
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        with _CACHE_LOCK, contextlib.suppress(OSError):
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f)
            os.replace(tmp, self.path)


__all__ = ["fingerprint_directory", "model_identity", "weights_namespace"]
