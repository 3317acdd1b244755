"""LMCache's multiprocess-mode ``ObjectKey`` as a Persisting key string, and back.

Every field maps, and the mapping is reversible, so ``list_l2_keys`` returns the original
``ObjectKey``s after a restart. All keys of one L2 adapter live in one Persisting model
namespace (one directory, one byte budget), so the namespace is the key's model part and
the object key's fields are tags::

    <namespace>@1@0@<chunk hash as hex>@uint8@m%<model>@r%<kv_rank>@g%<group>@n%<hash bytes>
        [@s%<cache_salt>]

``uint8``: the bytes' real dtype and shape are in the stored layout, checked on load.
Model and salt are percent-encoded (so no ``@``, ``%`` or control character reaches the key
string) and the hash's byte length is kept, so leading zero bytes survive. ``cache_salt``
is part of every key it was stored under: a lookup under one salt builds another key and
can never find another salt's chunk.

:func:`object_keys_for_tokens` gives the key strings of the chunks LMCache's multiprocess
server stores for token ids (its own token hasher and key expansion), so they can be
prewarmed by token ids (``persisting prewarm --hash-scheme lmcache-mp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote, unquote

from lmcache.v1.distributed.api import ObjectKey

from persisting.errors import InvalidKeyError
from persisting.kv import parse_key

#: The key dtype of every L2 chunk: opaque bytes (the stored layout says what they are).
KEY_DTYPE = "uint8"
_SAFE = "/:+,=~"


def object_key_text(namespace: str, key: ObjectKey) -> str:
    """The Persisting key string ``key`` is stored under in ``namespace``."""
    digest = int.from_bytes(key.chunk_hash, "big")
    text = (
        f"{namespace}@1@0@{digest:x}@{KEY_DTYPE}"
        f"@m%{quote(key.model_name, safe=_SAFE)}@r%{key.kv_rank}"
        f"@g%{key.object_group_id}@n%{len(key.chunk_hash)}"
    )
    if key.cache_salt:
        text += f"@s%{quote(key.cache_salt, safe=_SAFE)}"
    return text


def object_key_of(text: str) -> ObjectKey:
    """The ``ObjectKey`` a key string of :func:`object_key_text` was made from.

    Raises InvalidKeyError for a string that is not one (a chunk stored by something else).
    """
    parsed = parse_key(text)
    tags = dict(parsed.tags)
    try:
        length = int(tags["n"])
        return ObjectKey(
            chunk_hash=parsed.chunk_hash.to_bytes(length, "big"),
            model_name=unquote(tags["m"]),
            kv_rank=int(tags["r"]),
            object_group_id=int(tags["g"]),
            cache_salt=unquote(tags.get("s", "")),
        )
    except (KeyError, ValueError, OverflowError) as exc:
        raise InvalidKeyError(f"{text!r} is not an LMCache L2 object key") from exc


def object_keys_for_tokens(
    namespace: str,
    tokens: Sequence[int],
    *,
    model_name: str,
    chunk_size: int = 256,
    world_size: int = 1,
    worker_id: int | None = None,
    cache_salt: str = "",
    object_group_ids: Sequence[int] = (0,),
    hash_algorithm: str = "blake3",
) -> list[str]:
    """The key strings (in ``namespace``) of the chunks LMCache's multiprocess server stores
    for ``tokens``: its ``TokenHasher`` (``hash_algorithm``: its ``--hash-algorithm``, blake3
    by default; whole chunks only) and its ``ipc_key_to_object_keys`` (``worker_id`` None:
    every kv rank of ``world_size``), both LMCache's own code. Prefix order, for each object
    group in turn."""
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    ids = [int(t) for t in tokens]
    hashes = TokenHasher(chunk_size, hash_algorithm).compute_chunk_hashes(ids)
    try:
        ipc_key = IPCCacheServerKey(
            model_name=model_name,
            world_size=world_size,
            worker_id=worker_id,
            token_ids=tuple(ids),
            start=0,
            end=len(ids),
            request_id="persisting-prewarm",
            cache_salt=cache_salt,
        )
        groups = ipc_key_to_object_keys(ipc_key, hashes, list(object_group_ids)) if hashes else []
    except ValueError as exc:  # LMCache's own checks (a salt with '/', a bad rank...)
        raise InvalidKeyError(f"not an LMCache multiprocess key: {exc}") from exc
    return [object_key_text(namespace, key) for group in groups for key in group]


__all__ = ["KEY_DTYPE", "object_key_of", "object_key_text", "object_keys_for_tokens"]
