"""One exception hierarchy for every layer of Persisting.

Every user mistake (a malformed key, a path-unsafe name, a wrong layout) and every
storage failure surfaces as a subclass of :class:`PersistingError`, so callers can catch
one type. Each class carries a stable ``code`` so the service can send errors across the
wire and the client can raise the same type on the other side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self


class PersistingError(Exception):
    """Base class of every error Persisting raises on purpose."""

    code: str = "persisting_error"
    #: The inputs the message names, by their Python names (``"tp"``, ``"kv_heads"``), so a
    #: front end can name them its own way (the command line shows ``--tp``, ``--kv-heads``).
    fields: tuple[str, ...] = ()

    def about(self, *fields: str) -> Self:
        """This error, noting that its message names the inputs ``fields``."""
        self.fields = fields
        return self


class ConfigError(PersistingError, ValueError):
    """Settings that cannot work together, or a setting with an impossible value."""

    code = "config_error"


class UnsafeStorageError(ConfigError):
    """A storage root (or a directory or key file under it) that another user owns or can
    write: whoever controls it could plant or swap stored values, so it is refused."""

    code = "unsafe_storage"


class InvalidNameError(PersistingError, ValueError):
    """A model or topic name that cannot become a path component (empty, NUL, too long...)."""

    code = "invalid_name"


class InvalidKeyError(PersistingError, ValueError):
    """A chunk key that does not parse or does not belong to the store it is used with."""

    code = "invalid_key"


class InvalidValueError(PersistingError, ValueError):
    """A value of the wrong kind: unsupported dtype, zero size, bad format name..."""

    code = "invalid_value"


class LayoutMismatchError(PersistingError):
    """A stored value's layout (shape, dtype, format) differs from what the reader expects."""

    code = "layout_mismatch"


class CorruptValueError(PersistingError):
    """Stored bytes that fail their checksum or do not match their metadata."""

    code = "corrupt_value"


class CapacityError(PersistingError):
    """A value larger than a tier can ever hold, or a disk/memory budget that is exhausted."""

    code = "capacity"


class SchemaMismatchError(PersistingError):
    """A dataset whose schema cannot be reconciled with the one the caller asked for."""

    code = "schema_mismatch"


class StoreClosedError(PersistingError):
    """An operation on a store, queue or client that has been closed."""

    code = "closed"


class OffsetTrimmedError(PersistingError, LookupError):
    """A read from a queue offset that retention already trimmed (offsets are never reused)."""

    code = "offset_trimmed"


class StorageIOError(PersistingError, OSError):
    """The storage medium failed underneath us (I/O error, missing file...)."""

    code = "storage_io"


class ProtocolError(PersistingError):
    """A malformed, truncated or unsupported message on the service's wire protocol."""

    code = "protocol"


class SessionExpiredError(ProtocolError):
    """A request names a service session the server no longer holds (expired or restarted)."""

    code = "session_expired"


class AccessDeniedError(PersistingError):
    """A request for a namespace the server is not configured to serve."""

    code = "access_denied"


class NamespaceInUseError(PersistingError):
    """A namespace that cannot be dropped because a live store (a server) holds it open."""

    code = "namespace_in_use"


class NamespaceOwnedError(NamespaceInUseError):
    """A namespace (or a topic's consumer) that a live process already serves: one owner
    per namespace. ``holder`` describes that process when it could be read."""

    code = "namespace_owned"
    holder: object | None = None


class ServiceUnavailableError(PersistingError):
    """No live server could be reached for a request."""

    code = "unavailable"


def _all_subclasses(cls: type[PersistingError]) -> list[type[PersistingError]]:
    out: list[type[PersistingError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_class_for(code: str) -> type[PersistingError]:
    """The error class whose ``code`` is ``code`` (the base class for unknown codes)."""
    for cls in _all_subclasses(PersistingError):
        if cls.code == code:
            return cls
    return PersistingError


__all__ = [
    "AccessDeniedError",
    "CapacityError",
    "ConfigError",
    "CorruptValueError",
    "InvalidKeyError",
    "InvalidNameError",
    "InvalidValueError",
    "LayoutMismatchError",
    "NamespaceInUseError",
    "NamespaceOwnedError",
    "OffsetTrimmedError",
    "PersistingError",
    "ProtocolError",
    "SchemaMismatchError",
    "ServiceUnavailableError",
    "SessionExpiredError",
    "StorageIOError",
    "StoreClosedError",
    "UnsafeStorageError",
    "error_class_for",
]
