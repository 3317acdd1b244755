"""The server side of the protocol: one request in, one reply out, over local KV stores.

:class:`StorageHandler` owns the stores of the models a server is configured for, the
client sessions (:mod:`persisting.service.sessions`) and the same-host data path. It knows
nothing of Pulsing: the actor in :mod:`persisting.actors` only feeds it messages, so the whole
protocol is testable with plain function calls. Store calls run on a thread pool, so a slow put
(fsync) on one lane never stalls lookups on another.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from persisting.errors import (
    AccessDeniedError,
    CapacityError,
    CorruptValueError,
    InvalidValueError,
    PersistingError,
    ProtocolError,
)
from persisting.kv import KVStore, Layout
from persisting.kv.layout import checksum, decode_value
from persisting.lance_store.names import validate_name
from persisting.service.protocol import (
    MAX_KEYS_PER_REQUEST,
    PROTOCOL_VERSION,
    Request,
    error_reply,
    ok_reply,
    parse_request,
)
from persisting.service.same_host import ServerArenaMapping
from persisting.service.sessions import Session, SessionTable, Staged
from persisting.shm import aligned_buffer, round_to_page

#: Bytes of payload a single reply may carry inline on the message path.
DEFAULT_CHUNK_BYTES = 4 << 20

#: A stored value whose layout differs from what the reader expects: a miss, not a hit.
_LAYOUT_MISS = object()


class StorageHandler:
    """Answers protocol requests for the models of one server."""

    def __init__(
        self,
        stores: Mapping[str, KVStore],
        *,
        lease_ttl_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_inflight: int = 16,
        max_staged_bytes: int = 1 << 30,
        threads: int = 4,
        node: Mapping[str, Any] | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.stores = dict(stores)
        self.lease_ttl_s = lease_ttl_s
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.node = dict(node or {})
        self.node.setdefault("host", socket.gethostname())
        self.node.setdefault("pid", os.getpid())
        self.lanes: list[str] = []
        #: Path of the Unix socket same-host clients may send requests to (set by the actor).
        self.local_channel: str | None = None
        #: Named callables whose plain-dict results join the ``stats`` reply (e.g. "events").
        self.extra_stats: dict[str, Callable[[], dict[str, Any]]] = {}
        kwargs = {"clock": clock} if clock is not None else {}
        self.sessions = SessionTable(lease_ttl_s, max_staged_bytes=max_staged_bytes, **kwargs)
        self._lock = threading.Lock()  # guards the session table across pool threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-service")
        self.counters: Counter[str] = Counter()
        self._ops: dict[str, Callable[[Request, Session | None], Any]] = {
            "hello": self._hello,
            "bye": self._bye,
            "renew": self._renew,
            "put": self._put,
            "upload_begin": self._upload_begin,
            "upload_part": self._upload_part,
            "get": self._get,
            "read_part": self._read_part,
            "end_transfer": self._end_transfer,
            "release": self._release_op,
            "contains": self._contains,
            "layout": self._layout,
            "lookup_prefix": self._lookup_prefix,
            "remove": self._remove,
            "pin": self._pin,
            "unpin": self._unpin,
            "prefetch": self._prefetch,
            "touch": self._touch,
            "stats": self._stats,
        }

    # -- entry points -------------------------------------------------------------------

    async def handle(self, message: object) -> dict[str, Any]:
        """Answer one request; every failure becomes a structured error reply. Requests
        that may do file I/O run on the handler's threads, off the event loop."""
        if self.is_light(message):
            return self.answer(message)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.answer, message)

    def answer(self, message: object) -> dict[str, Any]:
        """:meth:`handle` on the calling thread (the local channel's threads use this)."""
        try:
            request = parse_request(message)
        except PersistingError as exc:
            self.counters["errors"] += 1
            return error_reply(exc)
        return self.handle_sync(request)

    @staticmethod
    def is_light(message: object) -> bool:
        """True for requests that do no file I/O (a memory copy at most), and for
        malformed ones (refusing them is quick)."""
        if not isinstance(message, dict):
            return True
        if message.get("op") in _LIGHT_OPS:
            return True
        # A same-host get copies memory-tier values into the client's arena (or just says
        # where they are) and leases the rest, whose bytes the client reads itself.
        return message.get("op") == "get" and bool(message.get("direct"))

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The threads that run requests doing file I/O."""
        return self._pool

    def handle_sync(self, request: Request) -> dict[str, Any]:
        self.counters[f"op_{request.op}"] += 1
        try:
            session = None
            if request.op not in ("hello", "stats") or request.sid is not None:
                with self._lock:  # an expired session is refused here; the sweeper frees it
                    session = self.sessions.touch(request.sid)
            if session is not None and request.args.get("release"):
                self._release(session, request.model, request.args["release"])
            if session is not None and request.args.get("touch"):
                # a hint riding along: a bad one must not fail the request it came with
                _quietly(self._touch_keys, request.model, request.args["touch"])
            return ok_reply(self._ops[request.op](request, session))
        except PersistingError as exc:
            self.counters["errors"] += 1
            return error_reply(exc)
        except Exception as exc:  # a bug or an unexpected library error: still a reply
            self.counters["errors"] += 1
            return error_reply(exc)

    def expire_sessions(self) -> int:
        """Give back what expired sessions held; returns how many expired."""
        with self._lock:
            return self._expire_locked()

    def close(self) -> None:
        with self._lock:
            for session in self.sessions.sessions():
                self.sessions.close(session.sid)
                self._give_back(session)
        self._pool.shutdown(wait=True)

    # -- sessions -----------------------------------------------------------------------

    def _expire_locked(self) -> int:
        gone = self.sessions.expire()
        for session in gone:
            self._give_back(session)
        self.counters["sessions_expired"] += len(gone)
        return len(gone)

    def _give_back(self, session: Session) -> None:
        """Undo a finished session's pins and leases (its counters are already dropped)."""
        for (model, key), count in session.pins.items():
            store = self.stores.get(model)
            for _ in range(count):
                if store is not None:
                    _quietly(store.unpin, key)
        session.pins.clear()
        for model, key in session.leases:
            store = self.stores.get(model)
            if store is not None and not self.sessions.is_leased((model, key)):
                _quietly(store.release, key)
        session.leases.clear()
        session.close_resources()

    def _hello(self, request: Request, _session: Session | None) -> dict[str, Any]:
        client = request.args.get("client") or {}
        if not isinstance(client, Mapping):
            raise ProtocolError("hello's client must be a dict")
        arena = client.get("arena")
        mapping = None
        shm_error = None
        if arena is not None:
            try:
                mapping = ServerArenaMapping(arena["path"], arena["size"], arena["nonce"])
            except (ProtocolError, KeyError, TypeError) as exc:
                shm_error = str(exc)
        with self._lock:
            session = self.sessions.open({k: v for k, v in client.items() if k != "arena"})
            if mapping is not None:
                session.resources.append(mapping)
        self.counters["sessions_opened"] += 1
        return {
            "sid": session.sid,
            "protocol": PROTOCOL_VERSION,
            "models": sorted(self.stores),
            # Token hashing must use the store's chunk size, or lookups quietly miss.
            "chunk_sizes": {m: getattr(s, "chunk_size", None) for m, s in self.stores.items()},
            "node": self.node,
            "lanes": list(self.lanes),
            "lease_ttl_s": self.lease_ttl_s,
            "chunk_bytes": self.chunk_bytes,
            "max_inflight": self.max_inflight,
            "shm": mapping is not None,
            "shm_error": shm_error,
            "local_channel": self.local_channel if mapping is not None else None,
            "pool": self._pool_of(request.model) if mapping is not None else None,
        }

    def _pool_of(self, model: str | None) -> dict[str, Any] | None:
        """Where a same-host client maps ``model``'s memory tier (None: no shared pool)."""
        store = self.stores.get(model) if model is not None else None
        pool = store.pool if store is not None else None
        return None if pool is None else {"path": str(pool.path), "size": pool.size}

    def _bye(self, request: Request, session: Session | None) -> bool:
        with self._lock:
            closed = self.sessions.close(request.sid)
            if closed is not None:
                self._give_back(closed)
        return closed is not None

    def _renew(self, _request: Request, session: Session | None) -> dict[str, int]:
        assert session is not None
        with self._lock:
            leases = list(session.leases)
        for model, key in leases:  # push the store's own lease deadlines out as well
            store = self.stores.get(model)
            if store is not None:
                _quietly(store.lease, key, self.lease_ttl_s)
        return {"pins": sum(session.pins.values()), "leases": len(leases)}

    # -- models -------------------------------------------------------------------------

    def _store(self, model: str | None) -> KVStore:
        validate_name(model, "model")
        assert model is not None
        store = self.stores.get(model)
        if store is None:
            raise AccessDeniedError(f"this server does not serve model {model!r}")
        return store

    # -- puts ---------------------------------------------------------------------------

    def _put(self, request: Request, session: Session | None) -> list[dict[str, Any]]:
        assert session is not None
        store = self._store(request.model)
        items = request.args["items"]
        fmt = request.args["fmt"]
        if not isinstance(items, list) or not items:
            raise ProtocolError("put needs a non-empty list of items")
        keys: list[str] = []
        values: list[Any] = []
        parents: list[str | None] = []
        uploads: list[str] = []
        for item in items:
            if not isinstance(item, Mapping):
                raise ProtocolError("each put item must be a dict")
            layout = _layout_from(item.get("layout"))
            data, upload = self._put_source(session, item, layout)
            values.append(decode_value(layout, data))
            keys.append(item.get("key"))
            parents.append(item.get("parent"))
            if upload is not None:
                uploads.append(upload)
        try:
            if len(keys) == 1:
                results = [store.put(keys[0], values[0], fmt=fmt, parent=parents[0])]
            else:
                results = store.batched_put(keys, values, fmt=fmt, parents=parents)
        finally:
            with self._lock:
                for upload in uploads:
                    self.sessions.unstage(session, upload)
        self.counters["put_items"] += len(keys)
        return [_put_result(r) for r in results]

    def _put_source(
        self, session: Session, item: Mapping[str, Any], layout: Layout
    ) -> tuple[np.ndarray, str | None]:
        """The payload of one put item as a uint8 array, and the upload it came from."""
        source = item.get("source")
        if not isinstance(source, Mapping) or len(source) != 1:
            raise ProtocolError("a put item needs exactly one source")
        if "shm" in source:
            mapping = _arena_of(session)
            offset = source["shm"]
            self.counters["put_bytes_shm"] += layout.nbytes
            return np.frombuffer(mapping.region(offset, layout.nbytes), np.uint8), None
        if "inline" in source:
            data = source["inline"]
            if not isinstance(data, bytes) or len(data) != layout.nbytes:
                raise ProtocolError("inline put data does not match its layout's size")
            _verify(data, item.get("checksum"))
            self.counters["put_bytes_message"] += layout.nbytes
            return np.frombuffer(data, np.uint8).copy(), None  # writable, as tensors need
        if "upload" in source:
            with self._lock:
                staged = self.sessions.staged(session, source["upload"])
            if staged.received != staged.nbytes or staged.nbytes != layout.nbytes:
                raise ProtocolError(
                    f"upload has {staged.received} of {staged.nbytes} bytes; "
                    f"the layout needs {layout.nbytes}"
                )
            _verify(staged.buffer, item.get("checksum"))
            self.counters["put_bytes_message"] += layout.nbytes
            return staged.buffer, source["upload"]
        raise ProtocolError(f"unknown put source {sorted(source)}")

    def _upload_begin(self, request: Request, session: Session | None) -> str:
        assert session is not None
        nbytes = request.args["nbytes"]
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidValueError(f"upload size must be a positive int, got {nbytes!r}")
        max_value = max(
            (s.max_value_bytes for s in self.stores.values() if hasattr(s, "max_value_bytes")),
            default=None,
        )
        if max_value is not None and nbytes > max_value:
            raise CapacityError(f"a {nbytes}-byte value exceeds max_value_bytes {max_value}")
        with self._lock:
            return self.sessions.stage(session, Staged(aligned_buffer(nbytes), nbytes))

    def _upload_part(self, request: Request, session: Session | None) -> int:
        assert session is not None
        with self._lock:
            staged = self.sessions.staged(session, request.args["upload"])
        offset, data = request.args["offset"], request.args["data"]
        if (
            not isinstance(data, bytes)
            or isinstance(offset, bool)
            or not isinstance(offset, int)
            or offset < 0
            or offset + len(data) > staged.nbytes
            or len(data) > self.chunk_bytes
        ):
            raise ProtocolError("upload part is outside its upload or larger than a chunk")
        staged.buffer[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        with self._lock:  # parts arrive on several threads at once
            staged.received += len(data)
            return staged.received

    # -- gets ---------------------------------------------------------------------------

    def _get(self, request: Request, session: Session | None) -> list[dict[str, Any] | None]:
        """Per key: None (a miss), or where the value is.

        A same-host client (``direct``) that mapped the store's shared pool (``pool``) gets
        a memory-tier value's place there, to copy it out itself. Failing that, a memory-tier
        value is copied into the window of its arena it offers (``arena: [offset,
        capacity]``) while room lasts; otherwise the payload file's location under a read
        lease, for the client to read itself; then, for
        a value only in the memory tier, a ``memory`` marker (it asks again with room for
        it). So a same-host get does no file I/O here, and runs on the event loop. Any other
        client gets the bytes in messages: inline, or a transfer to read in chunks.
        """
        assert session is not None
        store = self._store(request.model)
        keys: list[str] = request.args["keys"]
        expect = _optional_layout(request.args.get("expect"))
        direct = bool(request.args.get("direct")) and _arena_of(session, required=False) is not None
        window = request.args.get("arena")
        if window is not None and not (
            isinstance(window, list)
            and len(window) == 2
            and all(isinstance(x, int) for x in window)
        ):
            raise ProtocolError("arena must be [offset, capacity]")
        pooled = direct and bool(request.args.get("pool")) and store.pool is not None
        window_used = 0
        budget = self.chunk_bytes
        entries: list[dict[str, Any] | None] = []
        for key in keys:
            entry: Any = None
            if not direct:
                entry, sent = self._get_message(store, session, key, expect, budget)
                budget -= sent
            else:
                if pooled:
                    entry = self._get_pooled(store, key, expect)
                if entry is None and window is not None and _in_memory(store, key):
                    entry, used = self._get_into_arena(
                        store, session, key, expect, window, window_used
                    )
                    window_used += used
                if entry is None:
                    entry = self._get_located(store, session, request.model, key, expect)
                if entry is None:
                    layout = store.layout(key)
                    if layout is not None and (expect is None or layout.matches(expect)):
                        entry = {"layout": layout.to_dict(), "memory": True}
            if entry is _LAYOUT_MISS:
                entry = None
            entries.append(entry)
            self.counters["get_hits" if entry is not None else "get_misses"] += 1
        return entries

    def _get_pooled(self, store: KVStore, key: str, expect: Layout | None) -> dict[str, Any] | None:
        """A memory-tier value's place in the shared pool (the client copies it out); None
        otherwise, and the other paths (which also judge a layout mismatch) take over."""
        found = store.shared_location(key, expect=expect)
        if found is None:
            return None
        self.counters["get_bytes_pool"] += found.layout.nbytes
        return {"layout": found.layout.to_dict(), "pool": [found.offset, found.generation]}

    def _get_located(
        self,
        store: KVStore,
        session: Session,
        model: str | None,
        key: str,
        expect: Layout | None,
    ) -> dict[str, Any] | object | None:
        """The payload's file under a new read lease; None if not on disk, or _LAYOUT_MISS."""
        location = store.lease(key, self.lease_ttl_s)
        if location is None:
            return None
        holding = (str(model), key)
        if expect is not None and not location.layout.matches(expect):
            with self._lock:
                if not self.sessions.is_leased(holding):
                    store.release(key)
            self.counters["layout_misses"] += 1
            return _LAYOUT_MISS
        with self._lock:
            self.sessions.add_lease(session, holding)
        self.counters["get_bytes_direct"] += location.nbytes
        return {
            "layout": location.layout.to_dict(),
            "loc": [str(location.path), location.offset, location.nbytes, location.checksum],
        }

    def _get_into_arena(
        self,
        store: KVStore,
        session: Session,
        key: str,
        expect: Layout | None,
        window: list[int],
        used: int,
    ) -> tuple[dict[str, Any] | object | None, int]:
        """Copy ``key``'s value into the client's window after ``used`` bytes (page-aligned);
        (None, 0) when it is absent or does not fit, (_LAYOUT_MISS, 0) on a layout mismatch."""
        layout = store.layout(key)
        if layout is None:
            return None, 0
        if expect is not None and not layout.matches(expect):
            self.counters["layout_misses"] += 1
            return _LAYOUT_MISS, 0
        offset, capacity = window
        need = round_to_page(layout.nbytes)
        if used + need > capacity:
            return None, 0  # no room left in the window
        start = offset + used
        view = _arena_of(session).region(start, layout.nbytes)
        got = store.get_into(key, np.frombuffer(view, np.uint8), expect=expect)
        if got is None:
            return None, 0
        self.counters["get_bytes_shm"] += got.nbytes
        return {"layout": got.to_dict(), "shm": start}, need

    def _get_message(
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
        self.counters["get_bytes_message"] += got.nbytes
        if got.nbytes <= budget:
            return {
                "layout": got.to_dict(),
                "data": buffer.tobytes(),
                "checksum": digest,
            }, got.nbytes
        with self._lock:
            transfer = self.sessions.stage(session, Staged(buffer, got.nbytes, digest))
        return {"layout": got.to_dict(), "transfer": transfer, "checksum": digest}, 0

    def _read_part(self, request: Request, session: Session | None) -> bytes:
        assert session is not None
        transfer = request.args["transfer"]
        offset, length = request.args["offset"], request.args["length"]
        with self._lock:
            staged = self.sessions.staged(session, transfer)
        if (
            not isinstance(offset, int)
            or not isinstance(length, int)
            or offset < 0
            or length <= 0
            or length > self.chunk_bytes
            or offset + length > staged.nbytes
        ):
            raise ProtocolError("read_part is outside its transfer or larger than a chunk")
        data = staged.buffer[offset : offset + length].tobytes()
        with self._lock:  # parts are read on several threads at once
            staged.received += length
            if staged.received >= staged.nbytes:
                self.sessions.unstage(session, transfer)
        return data

    def _end_transfer(self, request: Request, session: Session | None) -> bool:
        assert session is not None
        with self._lock:
            return self.sessions.unstage(session, request.args["transfer"]) is not None

    def _release_op(self, request: Request, session: Session | None) -> int:
        assert session is not None
        return self._release(session, request.model, request.args["keys"])

    def _release(self, session: Session, model: str | None, keys: object) -> int:
        if not isinstance(keys, list):
            raise ProtocolError("release needs a list of keys")
        store = self.stores.get(str(model))
        released = 0
        for key in keys:
            with self._lock:
                last = self.sessions.drop_lease(session, (str(model), key))
            if last and store is not None:
                _quietly(store.release, key)
            released += 1
        return released

    def _touch(self, request: Request, _session: Session | None) -> int:
        return self._touch_keys(request.model, request.args["keys"])

    def _touch_keys(self, model: str | None, keys: object) -> int:
        """Hits a same-host client served itself from remembered pool locations."""
        if not isinstance(keys, list) or len(keys) > MAX_KEYS_PER_REQUEST:
            raise ProtocolError("touch needs a list of at most MAX_KEYS_PER_REQUEST keys")
        found = self._store(model).touch(keys)
        self.counters["get_hits"] += found
        self.counters["get_hits_remembered"] += found
        return found

    # -- index operations ----------------------------------------------------------------

    def _contains(self, request: Request, _session: Session | None) -> list[bool]:
        store = self._store(request.model)
        return [bool(store.contains(key)) for key in request.args["keys"]]

    def _layout(self, request: Request, _session: Session | None) -> list[dict[str, Any] | None]:
        store = self._store(request.model)
        out = []
        for key in request.args["keys"]:
            layout = store.layout(key)
            out.append(None if layout is None else layout.to_dict())
        return out

    def _lookup_prefix(self, request: Request, _session: Session | None) -> int:
        return int(self._store(request.model).lookup_prefix(request.args["keys"]))

    def _remove(self, request: Request, _session: Session | None) -> list[bool]:
        store = self._store(request.model)
        force = bool(request.args.get("force", True))
        return [bool(store.remove(key, force=force)) for key in request.args["keys"]]

    def _pin(self, request: Request, session: Session | None) -> list[bool]:
        assert session is not None
        store = self._store(request.model)
        out = []
        for key in request.args["keys"]:
            pinned = bool(store.pin(key))
            if pinned:
                with self._lock:
                    self.sessions.add_pin(session, (str(request.model), key))
            out.append(pinned)
        return out

    def _unpin(self, request: Request, session: Session | None) -> list[bool]:
        assert session is not None
        store = self._store(request.model)
        out = []
        for key in request.args["keys"]:
            with self._lock:
                held = self.sessions.drop_pin(session, (str(request.model), key))
            out.append(bool(store.unpin(key)) if held else False)
        return out

    def _prefetch(self, request: Request, _session: Session | None) -> int:
        return int(self._store(request.model).prefetch(request.args["keys"]))

    def _stats(self, request: Request, _session: Session | None) -> dict[str, Any]:
        models = [request.model] if request.model else sorted(self.stores)
        stores = {model: _plain_stats(self._store(model).stats()) for model in models}
        with self._lock:
            service = {
                "sessions": len(self.sessions),
                "pins": self.sessions.pin_count,
                "leases": self.sessions.lease_count,
                "staged_bytes": self.sessions.staged_bytes,
                **dict(self.counters),
            }
        extra = {name: _plain_stats(fn()) for name, fn in list(self.extra_stats.items())}
        return {"node": self.node, "stores": stores, "service": service, **extra}


# -- helpers ------------------------------------------------------------------------------

#: Operations that only touch in-memory indexes: answered on the event loop, sparing the
#: thread hop (about a third of a small request's latency here).
_LIGHT_OPS = frozenset(
    {
        "bye",
        "renew",
        "contains",
        "layout",
        "lookup_prefix",
        "pin",
        "unpin",
        "release",
        "touch",
        "end_transfer",
        "stats",
    }
)


def _in_memory(store: KVStore, key: str) -> bool:
    """Whether ``key`` is in the store's memory tier (a hint: it may leave at any time)."""
    try:
        return store.in_memory(key)
    except PersistingError:
        return False


def _arena_of(session: Session, required: bool = True) -> ServerArenaMapping | None:
    for resource in session.resources:
        if isinstance(resource, ServerArenaMapping):
            return resource
    if required:
        raise ProtocolError("this session has no shared-memory arena")
    return None


def _layout_from(value: object) -> Layout:
    if not isinstance(value, Mapping):
        raise ProtocolError("a layout must be a dict")
    try:
        layout = Layout.from_dict(dict(value))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed layout {value!r}: {exc}") from exc
    if layout.nbytes <= 0 or layout.kind not in ("torch", "numpy", "bytes"):
        raise InvalidValueError(f"unusable layout {value!r}")
    return layout


def _optional_layout(value: object) -> Layout | None:
    return None if value is None else _layout_from(value)


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
    }


def _plain_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Store stats reduced to plain values (the wire carries nothing else)."""
    out: dict[str, Any] = {}
    for name, value in stats.items():
        if isinstance(value, Mapping):
            out[str(name)] = _plain_stats(value)
        elif isinstance(value, bool | int | float | str) or value is None:
            out[str(name)] = value
        else:
            out[str(name)] = str(value)
    return out


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(PersistingError):
        fn(*args)


__all__ = ["DEFAULT_CHUNK_BYTES", "StorageHandler"]
