"""The data path's two requests on the server: ``get`` and ``put`` (frames:
:mod:`.frames`), each against one store, on one connection, each value within a deadline.

A get sends a memory-tier value from the tier's own buffer (``KVStore.memory_payload``:
the reference held while sending keeps its pool range from being freed and rewritten), a
value on disk from its payload file, opened under a read lease that is given back once the
file is open (a payload file once open stays whole: eviction only unlinks it), and, to a
same-host reader that maps the shared pool and asks for it, only where the value lies.

A put receives each payload straight into a buffer of the memory tier
(``KVStore.allocate``), hashing it as it lands; once every checksum matched, the store
keeps those buffers (``batched_put_owned``). Its bytes count against the session's and
the server's bounds on bytes in flight until it ends, however it ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from persisting.errors import CapacityError, CorruptValueError, PersistingError, ProtocolError
from persisting.kv import KVStore, Layout
from persisting.kv.keys import key_string
from persisting.kv.paths.puts import check_key_dtypes
from persisting.service.bulk.conn import Conn
from persisting.service.bulk.frames import MAX_PUT_ITEMS, ConnectionLost
from persisting.service.handler.common import ServerState, layout_from, optional_layout
from persisting.service.protocol import MAX_KEYS_PER_REQUEST
from persisting.service.sessions import Session


class Requests:
    """Answers gets and puts for the stores of ``state``; ``io_timeout_s`` bounds the
    sending or receiving of each value (a frame and its payload), whatever the peer does."""

    def __init__(self, state: ServerState, io_timeout_s: float):
        self.state = state
        self.io_timeout_s = io_timeout_s

    def deadline(self) -> float:
        return time.monotonic() + self.io_timeout_s

    # -- get ------------------------------------------------------------------------------

    def get(self, conn: Conn, session: Session, request: dict[str, Any]) -> None:
        store = self.state.store(request.get("model"))
        keys = request.get("keys")
        if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS_PER_REQUEST:
            raise ProtocolError(f"a get needs 1 to {MAX_KEYS_PER_REQUEST} keys")
        if not all(isinstance(k, str) for k in keys):
            raise ProtocolError("keys must be strings")
        expect = optional_layout(request.get("expect"))
        pooled = bool(request.get("pool")) and conn.kind == "unix" and store.shared_pool is not None
        counters = self.state.counters
        hits: list[str] = []
        for key in keys:
            sent = self._send_value(conn, store, key, expect, pooled)
            counters["get_hits" if sent is not None else "get_misses"] += 1
            if sent is not None:
                counters[f"get_from_{sent}"] += 1
                hits.append(key)
        self.state.used(request.get("model"), hits, "read")
        if request.get("learn"):
            told = None
            if pooled:
                told = self.state.placements.tell(session.placements_told, str(request["model"]))
                counters["placements_told"] += len(told["told"]) if told else 0
            conn.send_frame(told or {"told": []}, self.deadline())

    def _send_value(
        self, conn: Conn, store: KVStore, key: str, expect: Layout | None, pooled: bool
    ) -> str | None:
        """Send one value (where it lies in the pool, from memory, or from its payload
        file) or a miss; how it went (None: a miss)."""
        deadline = self.deadline()
        if pooled:
            found = store.shared_location(key, expect=expect)
            if found is not None:
                where = {"layout": found.layout.to_dict(), "pool": [found.offset, found.generation]}
                conn.send_frame(where, deadline)
                return "pool"
        held = store.memory_payload(key, expect=expect)
        if held is not None:
            header = {"layout": held.layout.to_dict(), "checksum": held.checksum, "tier": "memory"}
            conn.send_frame(header, deadline, held.buffer.data.cast("B"))
            return "memory"
        fd, location = self._open_payload(store, key, expect)
        if fd is None:
            conn.send_frame({"miss": True}, deadline)
            return None
        try:
            header = {"layout": location.layout.to_dict(), "checksum": location.checksum}
            header["tier"] = "disk"
            if conn.kind == "unix":  # the reader reads the file itself
                header["file"] = [location.offset, location.nbytes]
                conn.send_with_file(header, fd, deadline)
            else:
                conn.send_frame(header, deadline)
                conn.send_file(fd, location.offset, location.nbytes, deadline)
        finally:
            os.close(fd)
        return "disk"

    def _open_payload(
        self, store: KVStore, key: str, expect: Layout | None
    ) -> tuple[int | None, Any]:
        """The open payload file of a value on disk and its location, taken under a read
        lease given back once the file is open; (None, None) if it is not on disk."""
        location = store.lease(key, self.state.lease_ttl_s)
        if location is None:
            return None, None
        try:
            if expect is not None and not location.layout.matches(expect):
                self.state.counters["layout_misses"] += 1
                return None, None
            return os.open(location.path, os.O_RDONLY | os.O_CLOEXEC), location
        except OSError:
            return None, None
        finally:
            store.release(key, location.token)  # this lease only: another reader's holds

    # -- put ------------------------------------------------------------------------------

    def put(self, conn: Conn, session: Session, request: dict[str, Any]) -> None:
        items = request.get("items")
        if not isinstance(items, list) or not 0 < len(items) <= MAX_PUT_ITEMS:
            raise ConnectionLost(f"a put needs 1 to {MAX_PUT_ITEMS} items")  # out of step
        try:
            layouts = [layout_from(item.get("layout")) for item in items]
        except (PersistingError, AttributeError) as exc:
            raise ConnectionLost(f"unreadable put items: {exc}") from exc
        total = sum(layout.nbytes for layout in layouts)
        state = self.state
        try:
            store = state.store(request.get("model"))
            keys = [key_string(item.get("key")) for item in items]
            if request.get("check_shape") is not False:  # as an in-process put does
                check_key_dtypes(keys, layouts)
            largest = max(layout.nbytes for layout in layouts)
            if largest > store.max_value_bytes:
                raise CapacityError(
                    f"a {largest}-byte value exceeds max_value_bytes {store.max_value_bytes}"
                )
            with state.lock:
                state.sessions.stage(session, total)
        except PersistingError:
            for layout in layouts:  # stay in step: read what the client is sending anyway
                conn.discard(layout.nbytes + 8, self.deadline())
            raise
        try:
            replies = self._receive_and_store(conn, store, keys, items, layouts)
        finally:
            with state.lock:
                state.sessions.unstage(session, total)
        self._placed(store, str(request["model"]), items, replies, bool(request.get("pool")))
        how = "copy" if session.client.get("role") == "copies" else "put"
        state.used(request.get("model"), [r["key"] for r in replies if r["stored"]], how)
        state.counters["put_items"] += len(items)
        state.counters["put_bytes"] += total
        conn.send_frame({"results": replies}, self.deadline())

    def _receive_and_store(
        self,
        conn: Conn,
        store: KVStore,
        keys: list[str],
        items: list[Mapping[str, Any]],
        layouts: list[Layout],
    ) -> list[dict[str, Any]]:
        """Receive each payload into a buffer of the store's memory tier, hashing it as it
        lands; the store keeps those buffers once every checksum matched the client's."""
        buffers: list[np.ndarray] = []
        checksums: list[int] = []
        damaged = 0
        for layout in layouts:
            deadline = self.deadline()
            buffer = store.allocate(layout.nbytes)
            digest = conn.recv_payload(buffer.data.cast("B"), deadline)
            damaged += digest != conn.recv_checksum(deadline)
            buffers.append(buffer)
            checksums.append(digest)
        if damaged:
            self.state.counters["put_damaged"] += damaged
            raise CorruptValueError(f"{damaged} value(s) arrived damaged (checksum mismatch)")
        parents = [item.get("parent") for item in items]
        if not all(p is None or isinstance(p, str) for p in parents):
            raise ProtocolError("put parents must be key strings")
        results = store.batched_put_owned(keys, buffers, layouts, checksums, parents)
        return [
            {
                "key": str(r.key),
                "tier": str(r.tier),
                "durable": bool(r.durable),
                "stored": bool(r.stored),
                "conflict": bool(r.conflict),
            }
            for r in results
        ]

    def _placed(
        self,
        store: KVStore,
        model: str,
        items: list[Mapping[str, Any]],
        replies: list[dict[str, Any]],
        tell_writer: bool,
    ) -> None:
        """Note where each stored value lies in the shared pool: in the placement feed
        other same-host readers are told from and, with ``tell_writer``, in its reply
        (``pool``: ``[offset, generation]``, so the writer's first get of it asks nothing).
        Telling is not reading: no hit is counted and recency is left alone."""
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


__all__ = ["Requests"]
