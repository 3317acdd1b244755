"""The server's get paths, and what a reader gives back (read leases, transfers, touches).

For each key a ``get`` answers None (a miss) or where the value is, by the reader's path:

* same host, with the store's shared pool mapped (``pool``): a memory-tier value's
  ``pool`` location ``[offset, generation]``, which the client copies out itself;
* same host, with a window of its arena offered (``arena: [offset, capacity]``): a
  memory-tier value copied into the window, as ``arena: offset``;
* same host, a value on disk: its ``file`` location ``[path, offset, nbytes, checksum]``
  under a read lease, which the client reads itself and gives back with ``release``;
* same host, a value only in memory that could not be placed: ``memory: True`` (the client
  asks again with room for it);
* any other client: the bytes in the reply (``data``) or, past one message part, a
  ``transfer`` it reads in parts.

So a same-host get does no file I/O here and is answered without a thread hop. A pooled
get that asks to ``learn`` is answered ``{"entries": [...], ...}`` with the pool
placements other clients' puts made since this session's last such reply
(:mod:`.placements`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from persisting.errors import PersistingError, ProtocolError
from persisting.kv import KVStore, Layout
from persisting.kv.layout import checksum
from persisting.service.handler.common import (
    LAYOUT_MISS,
    ServerState,
    arena_of,
    optional_layout,
    quietly,
)
from persisting.service.protocol import MAX_KEYS_PER_REQUEST, Request
from persisting.service.sessions import Session, Staged
from persisting.shm import aligned_buffer, round_to_page


class GetPaths:
    """``get``, ``read_part``, ``end_transfer``, ``release`` and ``touch``."""

    def __init__(self, state: ServerState):
        self.state = state

    def get(
        self, request: Request, session: Session | None
    ) -> list[dict[str, Any] | None] | dict[str, Any]:
        assert session is not None
        store = self.state.store(request.model)
        keys: list[str] = request.args["keys"]
        expect = optional_layout(request.args.get("expect"))
        direct = bool(request.args.get("direct")) and arena_of(session, required=False) is not None
        window = request.args.get("arena")
        if window is not None and not (
            isinstance(window, list)
            and len(window) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in window)
        ):
            raise ProtocolError("arena must be [offset, capacity]")
        uses_arena = direct and window is not None
        with self.state.ticket(session, request.args.get("ticket"), needed=uses_arena):
            pooled = direct and bool(request.args.get("pool")) and store.shared_pool is not None
            if direct:
                entries = self._get_direct(
                    store, session, request.model, keys, expect, pooled, window
                )
            else:
                entries = self._get_messages(store, session, keys, expect)
        counters = self.state.counters
        hits = sum(entry is not None for entry in entries)
        counters["get_hits"] += hits
        counters["get_misses"] += len(entries) - hits
        if pooled and request.args.get("learn"):
            told = self.state.placements.tell(session.placements_told, str(request.model))
            counters["placements_told"] += len(told["told"]) if told else 0
            return {"entries": entries, **(told or {})}
        return entries

    def _get_direct(
        self,
        store: KVStore,
        session: Session,
        model: str | None,
        keys: list[str],
        expect: Layout | None,
        pooled: bool,
        window: list[int] | None,
    ) -> list[dict[str, Any] | None]:
        window_used = 0
        entries: list[dict[str, Any] | None] = []
        for key in keys:
            entry: Any = self._pool_location(store, key, expect) if pooled else None
            if entry is None and window is not None and _in_memory(store, key):
                entry, used = self._copy_into_window(
                    store, session, key, expect, window, window_used
                )
                window_used += used
            if entry is None:
                entry = self._file_location(store, session, model, key, expect)
            if entry is None:
                layout = store.layout(key)
                if layout is not None and (expect is None or layout.matches(expect)):
                    entry = {"layout": layout.to_dict(), "memory": True}
            entries.append(None if entry is LAYOUT_MISS else entry)
        return entries

    def _get_messages(
        self, store: KVStore, session: Session, keys: list[str], expect: Layout | None
    ) -> list[dict[str, Any] | None]:
        budget = self.state.message_part_bytes
        entries: list[dict[str, Any] | None] = []
        for key in keys:
            entry, sent = self._message(store, session, key, expect, budget)
            budget -= sent
            entries.append(entry)
        return entries

    def _pool_location(
        self, store: KVStore, key: str, expect: Layout | None
    ) -> dict[str, Any] | None:
        """A memory-tier value's location in the shared pool (the client copies it out);
        None otherwise, and the other paths (which also judge a layout mismatch) take over."""
        found = store.shared_location(key, expect=expect)
        if found is None:
            return None
        self.state.counters["get_bytes_pool"] += found.layout.nbytes
        return {"layout": found.layout.to_dict(), "pool": [found.offset, found.generation]}

    def _file_location(
        self,
        store: KVStore,
        session: Session,
        model: str | None,
        key: str,
        expect: Layout | None,
    ) -> dict[str, Any] | object | None:
        """The payload's file under a new read lease; None if not on disk, or LAYOUT_MISS."""
        state = self.state
        location = store.lease(key, state.lease_ttl_s)
        if location is None:
            return None
        if expect is not None and not location.layout.matches(expect):
            store.release(key, location.token)
            state.counters["layout_misses"] += 1
            return LAYOUT_MISS
        with state.lock:
            state.sessions.add_lease(session, (str(model), key), location.token)
        state.counters["get_bytes_file"] += location.nbytes
        return {
            "layout": location.layout.to_dict(),
            "file": [str(location.path), location.offset, location.nbytes, location.checksum],
        }

    def _copy_into_window(
        self,
        store: KVStore,
        session: Session,
        key: str,
        expect: Layout | None,
        window: list[int],
        used: int,
    ) -> tuple[dict[str, Any] | object | None, int]:
        """Copy ``key``'s value into the client's window after ``used`` bytes (page-aligned);
        (None, 0) when it is absent or does not fit, (LAYOUT_MISS, 0) on a layout mismatch."""
        layout = store.layout(key)
        if layout is None:
            return None, 0
        if expect is not None and not layout.matches(expect):
            self.state.counters["layout_misses"] += 1
            return LAYOUT_MISS, 0
        offset, capacity = window
        need = round_to_page(layout.nbytes)
        if used + need > capacity:
            return None, 0  # no room left in the window
        start = offset + used
        view = arena_of(session).region(start, layout.nbytes)  # type: ignore[union-attr]
        got = store.get_into(key, np.frombuffer(view, np.uint8), expect=expect)
        if got is None:
            return None, 0
        self.state.counters["get_bytes_arena"] += got.nbytes
        return {"layout": got.to_dict(), "arena": start}, need

    def _message(
        self,
        store: KVStore,
        session: Session,
        key: str,
        expect: Layout | None,
        budget: int,
    ) -> tuple[dict[str, Any] | None, int]:
        layout = store.layout(key)
        if layout is None:
            return None, 0
        buffer = aligned_buffer(layout.nbytes)
        got = store.get_into(key, buffer, expect=expect)
        if got is None:
            return None, 0
        digest = checksum(buffer)
        self.state.counters["get_bytes_message"] += got.nbytes
        if got.nbytes <= budget:
            entry = {"layout": got.to_dict(), "data": buffer.tobytes(), "checksum": digest}
            return entry, got.nbytes
        with self.state.lock:
            transfer = self.state.sessions.stage(session, Staged(buffer, got.nbytes, digest))
        return {"layout": got.to_dict(), "transfer": transfer, "checksum": digest}, 0

    def read_part(self, request: Request, session: Session | None) -> bytes:
        assert session is not None
        state = self.state
        transfer = request.args["transfer"]
        offset, length = request.args["offset"], request.args["length"]
        with state.lock:
            staged = state.sessions.staged(session, transfer)
        if (
            not isinstance(offset, int)
            or not isinstance(length, int)
            or offset < 0
            or length <= 0
            or length > state.message_part_bytes
            or offset + length > staged.nbytes
        ):
            raise ProtocolError("read_part is outside its transfer or larger than a part")
        data = staged.buffer[offset : offset + length].tobytes()
        with state.lock:  # parts are read on several threads at once; a repeat counts once
            with staged.lock:
                staged.add_part(offset, length)
                complete = staged.complete
            if complete:
                state.sessions.unstage(session, transfer)
        return data

    def end_transfer(self, request: Request, session: Session | None) -> bool:
        assert session is not None
        with self.state.lock:
            return self.state.sessions.unstage(session, request.args["transfer"]) is not None

    def release(self, request: Request, session: Session | None) -> int:
        assert session is not None
        return self.release_keys(session, request.model, request.args["keys"])

    def release_keys(self, session: Session, model: str | None, keys: object) -> int:
        """Give back read leases this session took (``release``, or riding on a request)."""
        if not isinstance(keys, list):
            raise ProtocolError("release needs a list of keys")
        state = self.state
        store = state.stores.get(str(model))
        released = 0
        for key in keys:
            with state.lock:
                token = state.sessions.drop_lease(session, (str(model), key))
            if token is not None and store is not None:
                quietly(store.release, key, token)
            released += 1
        return released

    def touch(self, request: Request, _session: Session | None) -> int:
        return self.touch_keys(request.model, request.args["keys"])

    def touch_keys(self, model: str | None, keys: object) -> int:
        """Hits a same-host client served itself from remembered pool locations."""
        if not isinstance(keys, list) or len(keys) > MAX_KEYS_PER_REQUEST:
            raise ProtocolError("touch needs a list of at most MAX_KEYS_PER_REQUEST keys")
        found = self.state.store(model).touch(keys)
        self.state.counters["get_hits"] += found
        self.state.counters["get_hits_remembered"] += found
        return found


def _in_memory(store: KVStore, key: str) -> bool:
    """Whether ``key`` is in the store's memory tier (a hint: it may leave at any time)."""
    try:
        return store.in_memory(key)
    except PersistingError:
        return False


__all__ = ["GetPaths"]
