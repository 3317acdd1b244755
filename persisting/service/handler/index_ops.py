"""The server's index operations: presence, layouts, prefix and token lookups, removal,
pins, prefetch and stats. None of them moves payload bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from persisting.errors import ProtocolError
from persisting.kv import TokenHasher
from persisting.kv.keys import HASH_SCHEMES
from persisting.service.handler.common import ServerState, plain_stats
from persisting.service.protocol import MAX_KEYS_PER_REQUEST, Request
from persisting.service.sessions import Session

#: The TokenHasher settings a ``lookup_tokens`` request may give (the model is the store's).
_HASHER_ARGS = {
    "chunk_size": int,
    "world_size": int,
    "worker_id": int,
    "dtype": str,
    "save_unfull_chunk": bool,
    "hash_scheme": str,
}


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class IndexOps:
    """``contains``, ``layout``, ``tiers``, ``lookup_prefix``, ``lookup_tokens``, ``remove``,
    ``pin``, ``unpin``, ``prefetch``, ``touch`` and ``stats``."""

    def __init__(self, state: ServerState, server_stats: Callable[[], dict[str, Any]]):
        self.state = state
        self._server_stats = server_stats

    def contains(self, request: Request, _session: Session | None) -> list[bool]:
        store = self.state.store(request.model)
        return store.batched_contains(request.args["keys"])  # one lock hold per batch

    def layout(self, request: Request, _session: Session | None) -> list[dict[str, Any] | None]:
        store = self.state.store(request.model)
        out = []
        for key in request.args["keys"]:
            layout = store.layout(key)
            out.append(None if layout is None else layout.to_dict())
        return out

    def tiers(self, request: Request, _session: Session | None) -> list[list[Any] | None]:
        """Per key, ``[tier, nbytes]`` of where a read would find it now ("memory" or
        "disk"), or None: what a client prices a load-or-recompute plan with."""
        store = self.state.store(request.model)
        out: list[list[Any] | None] = []
        for key in request.args["keys"]:
            layout = store.layout(key)
            if layout is None:
                out.append(None)
            else:
                out.append(["memory" if store.in_memory(key) else "disk", layout.nbytes])
        return out

    def lookup_prefix(self, request: Request, _session: Session | None) -> int:
        return int(self.state.store(request.model).lookup_prefix(request.args["keys"]))

    def lookup_tokens(self, request: Request, _session: Session | None) -> int:
        """Leading tokens covered by stored chunks, hashed here (so the store counts the
        hit tokens, as it does for an in-process lookup)."""
        store = self.state.store(request.model)
        tokens = request.args["tokens"]
        options = request.args.get("hasher") or {}
        if not isinstance(options, dict) or not set(options) <= set(_HASHER_ARGS):
            raise ProtocolError(f"hasher settings must be a dict of {sorted(_HASHER_ARGS)}")
        for name, value in options.items():
            if type(value) is not _HASHER_ARGS[name]:
                raise ProtocolError(f"hasher setting {name} must be {_HASHER_ARGS[name].__name__}")
        settings: dict[str, Any] = {"chunk_size": store.chunk_size, "scheme": store.hash_scheme}
        settings.update({k: v for k, v in options.items() if k != "hash_scheme"})
        if "hash_scheme" in options:
            if options["hash_scheme"] not in HASH_SCHEMES:
                raise ProtocolError(f"hash_scheme must be one of {HASH_SCHEMES}")
            settings["scheme"] = options["hash_scheme"]
        hasher = TokenHasher(str(request.model), **settings)
        limit = MAX_KEYS_PER_REQUEST * hasher.chunk_size
        if (
            not isinstance(tokens, list)
            or len(tokens) > limit
            or not all(type(t) is int and _INT64_MIN <= t <= _INT64_MAX for t in tokens)
        ):
            raise ProtocolError(f"tokens must be a list of at most {limit} 64-bit ints")
        return int(store.lookup_tokens(tokens, hasher=hasher))

    def remove(self, request: Request, _session: Session | None) -> list[bool]:
        store = self.state.store(request.model)
        force = bool(request.args.get("force", True))
        return [bool(store.remove(key, force=force)) for key in request.args["keys"]]

    def pin(self, request: Request, session: Session | None) -> list[bool]:
        assert session is not None
        state = self.state
        store = state.store(request.model)
        out = []
        for key in request.args["keys"]:
            pinned = bool(store.pin(key))
            if pinned:
                with state.lock:
                    state.sessions.add_pin(session, (str(request.model), key))
            out.append(pinned)
        return out

    def unpin(self, request: Request, session: Session | None) -> list[bool]:
        assert session is not None
        state = self.state
        store = state.store(request.model)
        out = []
        for key in request.args["keys"]:
            with state.lock:
                held = state.sessions.drop_pin(session, (str(request.model), key))
            out.append(bool(store.unpin(key)) if held else False)
        return out

    def prefetch(self, request: Request, _session: Session | None) -> int:
        return int(self.state.store(request.model).prefetch(request.args["keys"]))

    def touch(self, request: Request, _session: Session | None) -> int:
        return self.touch_keys(request.model, request.args["keys"])

    def touch_keys(self, model: str | None, keys: list[str]) -> int:
        """Hits a same-host client served itself from remembered pool locations."""
        found = self.state.store(model).touch(keys)
        self.state.used(model, keys, "read")
        self.state.counters["get_hits"] += found
        self.state.counters["get_hits_remembered"] += found
        return int(found)

    def stats(self, request: Request, _session: Session | None) -> dict[str, Any]:
        models = [request.model] if request.model else sorted(self.state.stores)
        stores = {model: plain_stats(self.state.store(model).stats()) for model in models}
        return {"stores": stores, **self._server_stats()}


__all__ = ["IndexOps"]
