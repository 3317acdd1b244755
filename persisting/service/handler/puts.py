"""The server's put paths: a batch of items, each from inline bytes, an upload, or the
client's shared-memory arena.

Bytes in the arena belong to a client process that could (through a bug) reuse them while
the server reads them. So a same-host put carries the checksum the client computed and a
ticket: the bytes are checked before they are stored and once more after the store has
copied them, and a ticket the client withdrew is refused without touching the arena
(:meth:`~persisting.service.sessions.SessionTable.withdraw`). Bytes that changed are a
:class:`~persisting.errors.CorruptValueError`, and whatever was stored from them is removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from persisting.errors import CapacityError, CorruptValueError, InvalidValueError, ProtocolError
from persisting.kv import KVStore, Layout
from persisting.kv.layout import checksum, decode_value
from persisting.service.handler.common import ServerState, arena_of, layout_from, quietly
from persisting.service.protocol import Request
from persisting.service.sessions import Session, Staged
from persisting.shm import aligned_buffer


class PutPaths:
    """``put``, ``upload_begin`` and ``upload_part``."""

    def __init__(self, state: ServerState):
        self.state = state

    def put(self, request: Request, session: Session | None) -> list[dict[str, Any]]:
        assert session is not None
        state = self.state
        store = state.store(request.model)
        items = request.args["items"]
        fmt = request.args["fmt"]
        if not isinstance(items, list) or not items:
            raise ProtocolError("put needs a non-empty list of items")
        if not all(isinstance(item, Mapping) for item in items):
            raise ProtocolError("each put item must be a dict")
        from_arena = any(
            isinstance(item.get("source"), Mapping) and "arena" in item["source"] for item in items
        )
        with state.ticket(session, request.args.get("ticket"), needed=from_arena):
            replies = self._put(store, session, items, fmt)
        tell_writer = bool(request.args.get("pool")) and arena_of(session, False) is not None
        self.record_placements(store, str(request.model), items, replies, tell_writer)
        return replies

    def record_placements(
        self,
        store: KVStore,
        model: str,
        items: list[Mapping[str, Any]],
        replies: list[dict[str, Any]],
        tell_writer: bool,
    ) -> None:
        """Note where each stored value lies in the shared pool: in the placement feed
        other same-host readers are told from and, with ``tell_writer``, in its reply
        (``pool``: ``[offset, generation]``, so a same-host writer's first get of it asks
        nothing). Telling is not reading: no hit is counted and recency is left alone."""
        if store.shared_pool is None:
            return
        for item, reply in zip(items, replies, strict=True):
            if not reply["stored"]:
                continue
            found = store.shared_location(reply["key"], count=False)
            if found is not None:
                if tell_writer:
                    reply["pool"] = [found.offset, found.generation]
                self.state.placements.record(
                    model, str(item.get("key")), found.layout, found.offset, found.generation
                )

    def _put(
        self, store: KVStore, session: Session, items: list[Mapping[str, Any]], fmt: Any
    ) -> list[dict[str, Any]]:
        keys: list[str] = []
        values: list[Any] = []
        parents: list[str | None] = []
        uploads: list[str] = []
        shared: list[tuple[int, np.ndarray, object]] = []  # arena bytes to check again
        for i, item in enumerate(items):
            layout = layout_from(item.get("layout"))
            data, upload = self._source(session, item, layout)
            if upload is not None:
                uploads.append(upload)
            if "arena" in item["source"]:
                shared.append((i, data, item.get("checksum")))
            values.append(decode_value(layout, data))
            keys.append(item.get("key"))  # type: ignore[arg-type]
            parents.append(item.get("parent"))
        try:
            if len(keys) == 1:
                results = [store.put(keys[0], values[0], fmt=fmt, parent=parents[0])]
            else:
                results = store.batched_put(keys, values, fmt=fmt, parents=parents)
        finally:
            with self.state.lock:
                for upload in uploads:
                    self.state.sessions.unstage(session, upload)
        changed = [i for i, data, digest in shared if checksum(data) != digest]
        if changed:  # the bytes moved under the store's copy: take back what it stored
            for i in changed:
                if results[i].stored:
                    quietly(store.remove, keys[i])
            self.state.counters["put_arena_changed"] += len(changed)
            raise CorruptValueError(
                f"{len(changed)} value(s) changed in the client's arena while being stored"
            )
        self.state.counters["put_items"] += len(keys)
        return [_put_result(r) for r in results]

    def _source(
        self, session: Session, item: Mapping[str, Any], layout: Layout
    ) -> tuple[np.ndarray, str | None]:
        """The payload of one put item as a uint8 array, and the upload it came from."""
        source = item.get("source")
        if not isinstance(source, Mapping) or len(source) != 1:
            raise ProtocolError("a put item needs exactly one source")
        counters = self.state.counters
        if "arena" in source:
            if item.get("checksum") is None:
                raise ProtocolError("a put from the arena needs the client's checksum")
            view = arena_of(session).region(source["arena"], layout.nbytes)  # type: ignore[union-attr]
            data = np.frombuffer(view, np.uint8)
            _verify(data, item["checksum"])
            counters["put_bytes_arena"] += layout.nbytes
            return data, None
        if "inline" in source:
            data = source["inline"]
            if not isinstance(data, bytes) or len(data) != layout.nbytes:
                raise ProtocolError("inline put data does not match its layout's size")
            _verify(data, item.get("checksum"))
            counters["put_bytes_message"] += layout.nbytes
            return np.frombuffer(data, np.uint8).copy(), None  # writable, as tensors need
        if "upload" in source:
            with self.state.lock:
                staged = self.state.sessions.staged(session, source["upload"])
            with staged.lock:
                complete = staged.complete
            if not complete or staged.nbytes != layout.nbytes:
                raise ProtocolError(
                    f"upload has {staged.received} of {staged.nbytes} bytes; "
                    f"the layout needs {layout.nbytes}"
                )
            _verify(staged.buffer, item.get("checksum"))
            counters["put_bytes_message"] += layout.nbytes
            return staged.buffer, source["upload"]
        raise ProtocolError(f"unknown put source {sorted(source)}")

    def upload_begin(self, request: Request, session: Session | None) -> str:
        assert session is not None
        nbytes = request.args["nbytes"]
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidValueError(f"upload size must be a positive int, got {nbytes!r}")
        max_value = max(
            (s.max_value_bytes for s in self.state.stores.values()),
            default=None,
        )
        if max_value is not None and nbytes > max_value:
            raise CapacityError(f"a {nbytes}-byte value exceeds max_value_bytes {max_value}")
        with self.state.lock:
            return self.state.sessions.stage(session, Staged(aligned_buffer(nbytes), nbytes))

    def upload_part(self, request: Request, session: Session | None) -> int:
        assert session is not None
        state = self.state
        with state.lock:
            staged = state.sessions.staged(session, request.args["upload"])
        offset, data = request.args["offset"], request.args["data"]
        if (
            not isinstance(data, bytes)
            or isinstance(offset, bool)
            or not isinstance(offset, int)
            or offset < 0
            or offset + len(data) > staged.nbytes
            or len(data) > state.message_part_bytes
        ):
            raise ProtocolError("upload part is outside its upload or larger than a part")
        with staged.lock:  # parts arrive on several threads at once; a repeat counts once
            staged.add_part(offset, len(data))
            staged.buffer[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
            return staged.received


def _verify(data: Any, expected: object) -> None:
    if expected is None:
        return
    if checksum(data) != expected:
        raise CorruptValueError("payload bytes do not match the checksum the client sent")


def _put_result(result: Any) -> dict[str, Any]:
    return {
        "key": str(result.key),
        "tier": str(result.tier),
        "durable": bool(result.durable),
        "stored": bool(result.stored),
        "conflict": bool(getattr(result, "conflict", False)),
    }


__all__ = ["PutPaths"]
