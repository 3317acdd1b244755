"""Prewarm and evict events: the records a queue topic carries to the storage service.

An event asks the service to load chunks into its memory tier (``prewarm``) or to drop
them from its index and disk (``evict``). It names its chunks either by key strings or by
token ids plus the hasher settings that turn them into keys (chunk size, world size,
worker id, dtype, hash scheme), so a scheduler that only knows token ids can still
prewarm::

    {"op": "prewarm", "model": "meta-llama/Llama-3-8B", "keys": ["...@...", ...]}
    {"op": "evict", "model": "...", "tokens": [1, 2, ...], "chunk_size": 256,
     "world_size": 1, "worker_id": 0, "dtype": "bfloat16", "hash_scheme": "lmcache"}

``hash_scheme`` is "persisting" (Persisting's own chain) or "lmcache" (the keys LMCache's
``ChunkedTokenDatabase`` gives: chunks an LMCache engine stored through a Persisting
plugin). A record without it (written before it existed) means "persisting".

Records are flat (no nested structs) so any queue backend stores them as plain columns;
fields an event does not use are written empty. Parsing checks everything and raises
:class:`~persisting.errors.InvalidValueError` for a record that is not an event.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from persisting.errors import InvalidKeyError, InvalidNameError, InvalidValueError
from persisting.kv import TokenHasher
from persisting.kv.keys import HASH_SCHEMES, HashScheme, key_string
from persisting.lance_store.names import validate_name

EventOp = Literal["prewarm", "evict"]
EVENT_OPS: tuple[EventOp, ...] = ("prewarm", "evict")

#: Most keys one event may name (a larger request is split into several events).
MAX_EVENT_KEYS = 4096


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One checked event; :meth:`keys` gives the chunk keys it applies to."""

    op: EventOp
    model: str
    key_strings: tuple[str, ...] = ()
    tokens: tuple[int, ...] = ()
    chunk_size: int = 256
    world_size: int = 1
    worker_id: int = 0
    dtype: str = "bfloat16"
    save_unfull_chunk: bool = False
    hash_scheme: HashScheme = "persisting"

    def keys(self) -> list[str]:
        """The key strings this event names (hashed from its tokens when it has them)."""
        if not self.tokens:
            return list(self.key_strings)
        hasher = TokenHasher(
            model=self.model,
            chunk_size=self.chunk_size,
            world_size=self.world_size,
            worker_id=self.worker_id,
            dtype=self.dtype,
            save_unfull_chunk=self.save_unfull_chunk,
            scheme=self.hash_scheme,
        )
        hashed = [str(key) for _s, _e, key in hasher.process_tokens(list(self.tokens))]
        return list(self.key_strings) + hashed

    def to_record(self) -> dict[str, Any]:
        """The flat queue record of this event (``id`` partitions it by model)."""
        return {
            "id": self.model,
            "op": self.op,
            "model": self.model,
            "keys": list(self.key_strings),
            "tokens": list(self.tokens),
            "chunk_size": self.chunk_size,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "dtype": self.dtype,
            "save_unfull_chunk": self.save_unfull_chunk,
            "hash_scheme": self.hash_scheme,
        }


def make_event(
    op: str,
    model: str,
    keys: Sequence[Any] | None = None,
    tokens: Sequence[int] | None = None,
    *,
    chunk_size: int = 256,
    world_size: int = 1,
    worker_id: int = 0,
    dtype: str = "bfloat16",
    save_unfull_chunk: bool = False,
    hash_scheme: str = "persisting",
) -> KVEvent:
    """A checked event from keys (ChunkKey or strings) and/or token ids."""
    record = {
        "op": op,
        "model": model,
        "keys": [key_string(k) for k in (keys or ())],
        "tokens": [int(t) for t in (tokens or ())],
        "chunk_size": chunk_size,
        "world_size": world_size,
        "worker_id": worker_id,
        "dtype": dtype,
        "save_unfull_chunk": save_unfull_chunk,
        "hash_scheme": hash_scheme,
    }
    return parse_event(record)


def prewarm_event(
    model: str,
    keys: Sequence[Any] | None = None,
    tokens: Sequence[int] | None = None,
    **hasher: Any,
) -> dict[str, Any]:
    """The queue record asking to load ``keys`` (or the chunks of ``tokens``) into memory."""
    return make_event("prewarm", model, keys, tokens, **hasher).to_record()


def evict_event(
    model: str,
    keys: Sequence[Any] | None = None,
    tokens: Sequence[int] | None = None,
    **hasher: Any,
) -> dict[str, Any]:
    """The queue record asking to drop ``keys`` (or the chunks of ``tokens``)."""
    return make_event("evict", model, keys, tokens, **hasher).to_record()


def parse_event(record: Mapping[str, Any]) -> KVEvent:
    """Check a queue record and turn it into a :class:`KVEvent`."""
    if not isinstance(record, Mapping):
        raise InvalidValueError(f"an event must be a dict, got {type(record).__name__}")
    op = record.get("op")
    if op not in EVENT_OPS:
        raise InvalidValueError(f"event op must be one of {EVENT_OPS}, got {op!r}")
    try:
        model = validate_name(record.get("model"), "model")
    except InvalidNameError as exc:
        raise InvalidValueError(f"bad event model: {exc}") from exc
    keys = _strings(record.get("keys"), "keys")
    tokens = _ints(record.get("tokens"), "tokens")
    if not keys and not tokens:
        raise InvalidValueError("an event needs keys or tokens")
    if len(keys) > MAX_EVENT_KEYS:
        raise InvalidValueError(f"an event names at most {MAX_EVENT_KEYS} keys")
    for key in keys:
        try:
            key_string(key)
        except InvalidKeyError as exc:
            raise InvalidValueError(f"event key {key!r} is not a chunk key: {exc}") from exc
        if key.split("@", 1)[0] != model:
            raise InvalidValueError(f"event key {key!r} is not a key of model {model!r}")
    event = KVEvent(
        op=op,
        model=model,
        key_strings=tuple(keys),
        tokens=tuple(tokens),
        chunk_size=_int(record.get("chunk_size", 256), "chunk_size", minimum=1),
        world_size=_int(record.get("world_size", 1), "world_size", minimum=1),
        worker_id=_int(record.get("worker_id", 0), "worker_id", minimum=0),
        dtype=str(record.get("dtype") or "bfloat16"),
        save_unfull_chunk=bool(record.get("save_unfull_chunk", False)),
        hash_scheme=_scheme(record.get("hash_scheme")),
    )
    if tokens:
        try:  # validates the hasher settings (dtype, ranks) up front
            TokenHasher(
                event.model, event.chunk_size, event.world_size, event.worker_id, event.dtype
            )
        except InvalidKeyError as exc:
            raise InvalidValueError(f"bad hasher settings in event: {exc}") from exc
    return event


def _scheme(value: object) -> HashScheme:
    if value is None or value == "":  # a record from before the field existed
        return "persisting"
    if value not in HASH_SCHEMES:
        raise InvalidValueError(f"event hash_scheme must be one of {HASH_SCHEMES}, got {value!r}")
    return cast(HashScheme, value)


def _strings(value: object, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise InvalidValueError(f"event {name} must be a list of strings")
    out = list(value)
    if not all(isinstance(v, str) for v in out):
        raise InvalidValueError(f"event {name} must be a list of strings")
    return out


def _ints(value: object, name: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise InvalidValueError(f"event {name} must be a list of ints")
    out: list[int] = []
    for v in value:  # numpy or Arrow integers from a queue read count as ints
        if isinstance(v, bool | float):
            raise InvalidValueError(f"event {name} must be a list of ints")
        try:
            out.append(operator.index(v))
        except TypeError as exc:
            raise InvalidValueError(f"event {name} must be a list of ints") from exc
    return out


def _int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidValueError(f"event {name} must be an int >= {minimum}, got {value!r}")
    return value


__all__ = [
    "EVENT_OPS",
    "MAX_EVENT_KEYS",
    "KVEvent",
    "evict_event",
    "make_event",
    "parse_event",
    "prewarm_event",
]
