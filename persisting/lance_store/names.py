"""Turning model ids and topic names into single, safe, reversible path components.

Real model ids contain ``/`` (``meta-llama/Llama-3-8B``) and topics may hold any text, so a
name is percent-encoded byte by byte: every byte outside ``[A-Za-z0-9_-]`` (and ``.``
anywhere but the first position) becomes ``%XX``, ``%`` itself included. The encoding is
injective (``a/b`` -> ``a%2Fb``, ``a_b`` -> ``a_b``, ``a%2Fb`` -> ``a%252Fb``), never
yields ``.``/``..`` or a separator, and :func:`decode_name` inverts it exactly.
"""

from __future__ import annotations

import string

from persisting.errors import InvalidNameError

#: Longest encoded component we create; most filesystems allow 255 bytes per component.
MAX_COMPONENT_BYTES = 240
#: Longest name (in UTF-8 bytes) accepted before encoding.
MAX_NAME_BYTES = 200

_SAFE = frozenset((string.ascii_letters + string.digits + "_-").encode())
_DOT = ord(".")


def validate_name(name: object, kind: str = "name") -> str:
    """Return ``name`` if it can become a path component, else raise InvalidNameError."""
    if not isinstance(name, str):
        raise InvalidNameError(f"{kind} must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidNameError(f"{kind} must not be empty")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        raise InvalidNameError(f"{kind} {name!r} contains NUL or control characters")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidNameError(f"{kind} {name!r} is not valid Unicode text") from exc
    if len(raw) > MAX_NAME_BYTES:
        raise InvalidNameError(f"{kind} is {len(raw)} bytes long; the limit is {MAX_NAME_BYTES}")
    return name


def encode_name(name: object, kind: str = "name") -> str:
    """Encode a validated name as one path component (see the module docstring)."""
    raw = validate_name(name, kind).encode("utf-8")
    parts: list[str] = []
    for index, byte in enumerate(raw):
        if byte in _SAFE or (byte == _DOT and index > 0):
            parts.append(chr(byte))
        else:
            parts.append(f"%{byte:02X}")
    encoded = "".join(parts)
    if len(encoded) > MAX_COMPONENT_BYTES:
        raise InvalidNameError(
            f"{kind} {name!r} encodes to {len(encoded)} bytes; the limit is {MAX_COMPONENT_BYTES}"
        )
    return encoded


def decode_name(component: str) -> str:
    """Invert :func:`encode_name`; raise InvalidNameError for text it could not have made."""
    out = bytearray()
    i = 0
    while i < len(component):
        ch = component[i]
        if ch == "%":
            hex_part = component[i + 1 : i + 3]
            if len(hex_part) != 2 or any(c not in "0123456789ABCDEF" for c in hex_part):
                raise InvalidNameError(f"not an encoded name: {component!r}")
            out.append(int(hex_part, 16))
            i += 3
            continue
        byte = ord(ch)
        if byte > 0x7F or not (byte in _SAFE or (byte == _DOT and i > 0)):
            raise InvalidNameError(f"not an encoded name: {component!r}")
        out.append(byte)
        i += 1
    try:
        name = out.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidNameError(f"not an encoded name: {component!r}") from exc
    if encode_name(name) != component:  # non-canonical spellings are not ours
        raise InvalidNameError(f"not an encoded name: {component!r}")
    return name


__all__ = ["MAX_NAME_BYTES", "decode_name", "encode_name", "validate_name"]
