"""The service's versioned control protocol: the table of operations, envelopes and checks.

Every request is a plain dict ``{"v": 2, "op": ..., "sid": ..., "model": ..., **args}`` and
every reply is ``{"v": 2, "ok": True, "result": ...}`` or ``{"v": 2, "ok": False, "error":
{"code": ..., "message": ...}}``. Only plain values travel (dict, list, str, int, float,
bool, None, bytes), so either side can decode a message without trusting the other to send
code: replies are unpickled with :func:`safe_loads`, which refuses every class.

Errors are never raised across the wire: the server turns a :class:`PersistingError` into
its ``code`` and the client raises the same class again (:func:`unwrap_reply`).

:data:`OPS` is the one table of operations: the server's dispatch, which requests it
answers without a thread hop, and which need no model all derive from it. These messages
ride on Pulsing (the control path) and never carry a value: values move on data
connections in the frames of :mod:`persisting.service.bulk.frames`.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from persisting.errors import PersistingError, ProtocolError, error_class_for

#: Bumped on any incompatible change; a server refuses requests of another version.
#: 3: values move only on data connections (no ``get``/``put`` messages); ``hello`` names
#: them (``data``).
PROTOCOL_VERSION = 3


@dataclass(frozen=True, slots=True)
class Op:
    """What the protocol knows of one operation."""

    #: Arguments a request must carry (others are optional).
    args: tuple[str, ...] = ()
    #: Concerns the session or the whole server rather than one model's store.
    model_free: bool = False
    #: Does no file I/O (a memory copy at most): answered on the receiving thread or event
    #: loop instead of the handler's thread pool.
    light: bool = False


#: Every operation a server answers.
OPS: dict[str, Op] = {
    "hello": Op(model_free=True, light=True),
    "bye": Op(model_free=True, light=True),
    "renew": Op(model_free=True, light=True),
    "touch": Op(("keys",), light=True),
    "contains": Op(("keys",), light=True),
    "layout": Op(("keys",), light=True),
    "tiers": Op(("keys",), light=True),
    "lookup_prefix": Op(("keys",), light=True),
    "lookup_tokens": Op(("tokens",), light=True),
    "remove": Op(("keys",)),
    "pin": Op(("keys",), light=True),
    "unpin": Op(("keys",), light=True),
    "prefetch": Op(("keys",)),
    "stats": Op(model_free=True, light=True),
}

#: Operations that do not name a model (derived from :data:`OPS`).
MODEL_FREE_OPS = frozenset(name for name, op in OPS.items() if op.model_free)


def is_light(message: object) -> bool:
    """True for a request that does no file I/O, and for a malformed one (refusing it is
    quick): such requests are answered without a hop to the handler's threads."""
    if not isinstance(message, Mapping):
        return True
    name = message.get("op")
    op = OPS.get(name) if isinstance(name, str) else None
    return op is None or op.light


#: Most keys one request may carry (bounds the work and the reply size of one message).
MAX_KEYS_PER_REQUEST = 4096

_PLAIN_TYPES = (str, int, float, bool, bytes, type(None))


@dataclass(frozen=True, slots=True)
class Request:
    """A checked request: the operation, its session and model, and its arguments."""

    op: str
    sid: str | None
    model: str | None
    args: dict[str, Any] = field(default_factory=dict)


def make_request(
    op: str, *, sid: str | None = None, model: str | None = None, **args: Any
) -> dict[str, Any]:
    """The wire form of one request."""
    if op not in OPS:
        raise ProtocolError(f"unknown operation {op!r}")
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op, "sid": sid, "model": model}
    message.update(args)
    return message


def parse_request(message: object) -> Request:
    """Check a received request; raise ProtocolError for anything malformed."""
    if not isinstance(message, Mapping):
        raise ProtocolError(f"a request must be a dict, got {type(message).__name__}")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this server speaks {PROTOCOL_VERSION})"
        )
    op = message.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown operation {op!r}")
    sid = message.get("sid")
    if sid is not None and not isinstance(sid, str):
        raise ProtocolError("sid must be a string")
    model = message.get("model")
    if op not in MODEL_FREE_OPS and not isinstance(model, str):
        raise ProtocolError(f"operation {op!r} needs a model name")
    args = {k: v for k, v in message.items() if k not in ("v", "op", "sid", "model")}
    missing = [name for name in OPS[op].args if name not in args]
    if missing:
        raise ProtocolError(f"operation {op!r} is missing {', '.join(missing)}")
    if "keys" in args:  # required by most operations
        _check_keys(args["keys"])
    touch = args.get("touch")  # hits served from remembered locations, riding along
    if touch is not None and not (
        isinstance(touch, list)
        and len(touch) <= MAX_KEYS_PER_REQUEST
        and all(isinstance(k, str) for k in touch)
    ):
        raise ProtocolError("touch must be a list of key strings")
    return Request(op=op, sid=sid, model=model, args=args)


def _check_keys(keys: object) -> None:
    if not isinstance(keys, list):
        raise ProtocolError("keys must be a list")
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(f"{len(keys)} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    for key in keys:
        if isinstance(key, list):  # one rank's keys in a multi-rank lookup_prefix
            if not all(isinstance(k, str) for k in key):
                raise ProtocolError("keys must be strings")
        elif not isinstance(key, str):
            raise ProtocolError("keys must be strings")


def ok_reply(result: Any = None) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": True, "result": result}


def error_reply(exc: BaseException) -> dict[str, Any]:
    """The structured reply for an exception (unexpected ones become the base code)."""
    code = exc.code if isinstance(exc, PersistingError) else PersistingError.code
    message = str(exc) if isinstance(exc, PersistingError) else f"{type(exc).__name__}: {exc}"
    return {"v": PROTOCOL_VERSION, "ok": False, "error": {"code": code, "message": message}}


def unwrap_reply(reply: object) -> Any:
    """The result of a reply, or raise the error it carries as its persisting.errors type."""
    if not isinstance(reply, Mapping) or reply.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"malformed reply: {_describe(reply)}")
    if reply.get("ok") is True:
        return reply.get("result")
    error = reply.get("error")
    if not isinstance(error, Mapping):
        raise ProtocolError(f"malformed error reply: {_describe(reply)}")
    cls = error_class_for(str(error.get("code", "")))
    raise cls(str(error.get("message", "")))


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain containers and scalars only; any class reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise ProtocolError(f"refusing to unpickle {module}.{name} from the wire")


def safe_loads(data: bytes | memoryview) -> Any:
    """Decode a pickled message that may contain only plain values."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except ProtocolError:
        raise
    except Exception as exc:  # truncated or garbled bytes
        raise ProtocolError(f"undecodable message: {exc}") from exc


def is_plain(value: object, depth: int = 0) -> bool:
    """True if ``value`` holds only the plain types this protocol allows."""
    if depth > 16:
        return False
    kind = type(value)  # exact types: a subclass may carry behaviour
    if kind in _PLAIN_TYPES:
        return True
    if isinstance(value, list | tuple) and kind in (list, tuple):
        return all(is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict) and kind is dict:
        return all(isinstance(k, str) and is_plain(v, depth + 1) for k, v in value.items())
    return False


__all__ = [
    "MAX_KEYS_PER_REQUEST",
    "MODEL_FREE_OPS",
    "OPS",
    "PROTOCOL_VERSION",
    "Op",
    "Request",
    "error_reply",
    "is_light",
    "is_plain",
    "make_request",
    "ok_reply",
    "parse_request",
    "safe_loads",
    "unwrap_reply",
]
