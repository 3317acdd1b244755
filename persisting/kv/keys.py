"""Chunk keys in LMCache's string format, and prefix-chained token hashing.

A key's string form is LMCache's ``CacheEngineKey`` format,
``model@world_size@worker_id@<chunk hash hex>@dtype[@tag%value...]`` (the layer-wise form
inserts ``@<layer id>`` after the dtype), so keys round-trip losslessly between Persisting
and LMCache. :class:`TokenHasher` computes chunk hashes by one of two schemes: Persisting's
own (``"persisting"``: xxh3 over the previous chunk's hash and the chunk's token ids), or
LMCache's (``"lmcache"``: what LMCache's ``ChunkedTokenDatabase`` computes, so chunks an
LMCache engine stored are found by their token ids). Both are identical on every process
and machine.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import xxhash

from persisting.errors import InvalidKeyError, InvalidValueError

#: dtype names exactly as LMCache writes them into keys.
KEY_DTYPES = frozenset(
    {
        "half",
        "bfloat16",
        "float",
        "double",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "fp8_e4m3fn",
        "fp8_e4m3fnuz",
        "fp8_e5m2",
        "fp8_e5m2fnuz",
    }
)

#: torch's names (``str(torch.float32)`` without ``torch.``) of the key dtypes whose LMCache
#: spelling differs; a key built with one of them is spelled LMCache's way.
TORCH_DTYPE_NAMES = {
    "float16": "half",
    "float32": "float",
    "float64": "double",
    "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
}


def key_dtype(dtype: object) -> str:
    """The key spelling (LMCache's: ``bfloat16``, ``half``, ``float``...) of ``dtype``: a
    key dtype name, torch's name (``float32``, ``float16``...), ``"torch.float32"`` or a
    ``torch.dtype``. Anything else is an InvalidKeyError listing the valid names."""
    name = str(dtype).removeprefix("torch.")
    name = TORCH_DTYPE_NAMES.get(name, name)
    if name not in KEY_DTYPES:
        raise InvalidKeyError(f"unknown key dtype {dtype!r}; valid: {_valid_dtypes()}")
    return name


def _valid_dtypes() -> str:
    aliases = {v: k for k, v in TORCH_DTYPE_NAMES.items()}
    return ", ".join(
        f"{name} ({aliases[name]})" if name in aliases else name for name in sorted(KEY_DTYPES)
    )


#: Longest key string accepted (keys become index entries and file headers).
MAX_KEY_CHARS = 1024


def _check_model(model: object) -> str:
    if not isinstance(model, str) or not model:
        raise InvalidKeyError(f"model name must be a non-empty string, got {model!r}")
    if "@" in model or any(ord(c) < 0x20 for c in model):
        raise InvalidKeyError(f"model name {model!r} must not contain '@' or control characters")
    return model


def _check_tag(name: str, value: str) -> None:
    for part in (name, value):
        if not isinstance(part, str) or "@" in part or any(ord(c) < 0x20 for c in part):
            raise InvalidKeyError(f"bad tag {name!r}={value!r}")
    if not name or "%" in name:
        raise InvalidKeyError(f"bad tag name {name!r}")


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One chunk of one rank's KV cache, identified the way LMCache identifies it."""

    model: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    tags: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        _check_model(self.model)
        for name in ("world_size", "worker_id", "chunk_hash"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidKeyError(f"{name} must be an int, got {value!r}")
        # LMCache does not require worker_id < world_size (some deployments number workers
        # globally), so neither do we: keys it writes must round-trip.
        if self.world_size < 1 or self.worker_id < 0:
            raise InvalidKeyError(
                f"world_size must be >= 1 and worker_id >= 0, got {self.world_size}, "
                f"{self.worker_id}"
            )
        if self.dtype not in KEY_DTYPES:  # torch's name: spelled LMCache's way in the key
            object.__setattr__(self, "dtype", key_dtype(self.dtype))
        for tag in self.tags:
            if not (isinstance(tag, tuple) and len(tag) == 2):
                raise InvalidKeyError(f"tags must be (name, value) pairs, got {tag!r}")
            _check_tag(*tag)

    @property
    def chunk_hash_hex(self) -> str:
        return f"{self.chunk_hash:x}"

    def _head(self) -> str:
        return f"{self.model}@{self.world_size}@{self.worker_id}@{self.chunk_hash_hex}@{self.dtype}"

    def _tail(self) -> str:
        return "".join(f"@{name}%{value}" for name, value in self.tags)

    def to_string(self) -> str:
        return self._head() + self._tail()

    def __str__(self) -> str:
        return self.to_string()

    def with_worker(self, worker_id: int) -> ChunkKey:
        """The same chunk's key on another rank."""
        return ChunkKey(
            self.model, self.world_size, worker_id, self.chunk_hash, self.dtype, self.tags
        )

    def split_layers(self, num_layers: int) -> list[LayerChunkKey]:
        return [
            LayerChunkKey(
                self.model,
                self.world_size,
                self.worker_id,
                self.chunk_hash,
                self.dtype,
                self.tags,
                layer_id=i,
            )
            for i in range(num_layers)
        ]

    @classmethod
    def from_string(cls, text: str) -> ChunkKey:
        key = parse_key(text)
        if type(key) is not ChunkKey and cls is ChunkKey:
            return key  # a layer key parses to LayerChunkKey, a ChunkKey subclass
        if not isinstance(key, cls):
            raise InvalidKeyError(f"{text!r} is not a {cls.__name__}")
        return key


@dataclass(frozen=True, slots=True)
class LayerChunkKey(ChunkKey):
    """A chunk key of one layer (LMCache's ``LayerCacheEngineKey``)."""

    layer_id: int = 0

    def __post_init__(self) -> None:
        ChunkKey.__post_init__(self)
        if (
            isinstance(self.layer_id, bool)
            or not isinstance(self.layer_id, int)
            or self.layer_id < 0
        ):
            raise InvalidKeyError(f"layer_id must be a non-negative int, got {self.layer_id!r}")

    def to_string(self) -> str:
        return f"{self._head()}@{self.layer_id}{self._tail()}"

    def chunk(self) -> ChunkKey:
        """The whole-chunk key this layer belongs to."""
        return ChunkKey(
            self.model, self.world_size, self.worker_id, self.chunk_hash, self.dtype, self.tags
        )


AnyKey = ChunkKey | str


_DIGITS = {10: frozenset("0123456789"), 16: frozenset("0123456789abcdefABCDEF")}


def _parse_int(text: str, base: int, what: str, source: str) -> int:
    body = text[1:] if text[:1] == "-" else text
    if not body or not set(body) <= _DIGITS[base]:
        raise InvalidKeyError(f"bad {what} {text!r} in key {source!r}")
    return int(text, base)


def parse_key(text: object) -> ChunkKey:
    """Parse LMCache's key string; a numeric 6th part makes a :class:`LayerChunkKey`."""
    if isinstance(text, ChunkKey):
        return text
    if not isinstance(text, str):
        raise InvalidKeyError(f"a key must be a string or ChunkKey, got {type(text).__name__}")
    if len(text) > MAX_KEY_CHARS:
        raise InvalidKeyError(f"key is {len(text)} characters long; the limit is {MAX_KEY_CHARS}")
    parts = text.split("@")
    if len(parts) < 5:
        raise InvalidKeyError(f"not a chunk key (want model@world@worker@hash@dtype): {text!r}")
    model, world, worker, chunk_hash, dtype = parts[:5]
    if dtype not in KEY_DTYPES:  # a string is kept verbatim: it must be spelled as stored
        spelled = TORCH_DTYPE_NAMES.get(dtype)
        hint = f" (keys spell {dtype} {spelled!r})" if spelled else f"; valid: {_valid_dtypes()}"
        raise InvalidKeyError(f"unknown key dtype {dtype!r} in key {text!r}{hint}")
    rest = parts[5:]
    layer_id: int | None = None
    if rest and rest[0].isdigit():
        layer_id = int(rest[0])
        rest = rest[1:]
    tags: list[tuple[str, str]] = []
    for item in rest:
        name, sep, value = item.partition("%")
        if not sep:
            raise InvalidKeyError(f"bad tag {item!r} in key {text!r}")
        tags.append((name, value))
    key_fields = (
        model,
        _parse_int(world, 10, "world size", text),
        _parse_int(worker, 10, "worker id", text),
        _parse_int(chunk_hash, 16, "chunk hash", text),
        dtype,
        tuple(tags),
    )
    if layer_id is not None:
        return LayerChunkKey(*key_fields, layer_id=layer_id)
    return ChunkKey(*key_fields)


def key_string(key: object) -> str:
    """The string a key is stored under: validated, and kept verbatim.

    Strings are not re-spelled (LMCache may write hashes with leading zeros), so whatever
    string a caller stores is exactly the string it finds again.
    """
    if isinstance(key, ChunkKey):
        return key.to_string()
    if not isinstance(key, str):
        parse_key(key)  # raises the typed error
    return _checked(key)


def key_hash(key: str) -> int:
    """The 64-bit hash a key string is known by everywhere it is not spelled out: the name
    of its payload file, its slot in the reuse stats, its entry in the saved eviction
    order. Never 0 (an empty slot's)."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8")) or 1


def rank_keys(key: str) -> list[str]:
    """The keys of ``key``'s chunk on every tensor-parallel rank -- its string with each
    worker id in turn, the rest kept verbatim -- or none for a key of world size 1 (or not
    a chunk key): ``model@world@worker@hash@dtype...``."""
    parts = key.split("@", 3)
    if len(parts) < 4 or not parts[1].isdigit() or int(parts[1]) < 2:
        return []
    return [f"{parts[0]}@{parts[1]}@{worker}@{parts[3]}" for worker in range(int(parts[1]))]


@lru_cache(maxsize=1 << 16)
def _checked(text: str) -> str:
    """``text`` once it parses; remembered, since the same keys are looked up again and again
    (contains, then get, then pin...). Failures are not cached: they raise every time."""
    parse_key(text)
    return text


HashScheme = Literal["persisting", "lmcache"]
HASH_SCHEMES: tuple[str, ...] = ("persisting", "lmcache")

_MASK64 = (1 << 64) - 1
_HASH_MODULUS = (1 << 61) - 1  # CPython's integer hash modulus on 64-bit builds
_XXPRIME_1 = 11400714785074694791
_XXPRIME_2 = 14029467366897019727
_XXPRIME_5 = 2870177450012600261
#: True where ``hash()`` of an int tuple is CPython's 64-bit algorithm (LMCache's platform).
_NATIVE_TUPLE_HASH = (
    sys.implementation.name == "cpython"
    and sys.hash_info.width == 64
    and sys.hash_info.modulus == _HASH_MODULUS
)


def _int_hash(value: int) -> int:
    """CPython's ``hash(int)`` on a 64-bit build (as an unsigned 64-bit lane)."""
    h = abs(value) % _HASH_MODULUS
    if value < 0:
        h = -h
    if h == -1:
        h = -2
    return h & _MASK64


def _tuple_hash(lanes: Sequence[int]) -> int:
    """CPython's (3.8+) tuple hash over already-hashed items, as a signed 64-bit int."""
    acc = _XXPRIME_5
    for lane in lanes:
        acc = (acc + lane * _XXPRIME_2) & _MASK64
        acc = ((acc << 31) | (acc >> 33)) & _MASK64
        acc = (acc * _XXPRIME_1) & _MASK64
    acc = (acc + (len(lanes) ^ (_XXPRIME_5 ^ 3527539))) & _MASK64
    if acc == _MASK64:
        return 1546275796
    return acc - (1 << 64) if acc >= 1 << 63 else acc


_EMPTY_TUPLE_LANE = _tuple_hash(()) & _MASK64


def lmcache_chunk_hash(prefix_hash: int, tokens: Sequence[int]) -> int:
    """One chunk's hash as LMCache's ``ChunkedTokenDatabase`` computes it by default.

    That is Python's built-in ``hash((prefix_hash, tuple(tokens), ()))`` (its
    ``pre_caching_hash_algorithm: builtin``), which is deterministic for int tuples:
    ``PYTHONHASHSEED`` salts only str and bytes. On CPython 64-bit this *is* the built-in
    hash; elsewhere the same algorithm is computed here, so the result never depends on
    the platform this process runs on.
    """
    if _NATIVE_TUPLE_HASH:
        return hash((prefix_hash, tuple(tokens), ()))
    inner = _tuple_hash([_int_hash(t) for t in tokens]) & _MASK64
    return _tuple_hash([_int_hash(prefix_hash), inner, _EMPTY_TUPLE_LANE])


_INT64_MAX = (1 << 63) - 1


def token_ids(tokens: Iterable[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a flat little-endian int64 array; anything that is not a sequence of
    integer ids fitting 64 bits (text, floats, huge numbers) is an InvalidValueError."""
    if isinstance(tokens, str | bytes | bytearray):
        raise InvalidValueError("tokens must be integer token ids, not text")
    try:
        ids = np.asarray(tokens)
        if ids.dtype == object and ids.ndim == 0:  # an iterator or generator
            ids = np.asarray(list(tokens))
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise InvalidValueError(f"tokens must be integer token ids: {exc}") from exc
    if ids.size == 0:
        return np.empty(0, dtype="<i8")
    if ids.dtype.kind not in "iu":
        raise InvalidValueError(
            f"tokens must be integer token ids that fit 64 bits, not {ids.dtype}"
        )
    if ids.dtype.kind == "u" and int(ids.max()) > _INT64_MAX:
        raise InvalidValueError("token ids must fit a signed 64-bit integer")
    return np.ascontiguousarray(ids.reshape(-1), dtype="<i8")


class TokenHasher:
    """Chunked, prefix-chained, process-independent hashing of token ids into ChunkKeys.

    ``scheme="persisting"`` (the default): chunk ``i``'s hash is
    ``xxh3_64(prev_hash_bytes || tokens_i as little-endian int64)`` interpreted as a signed
    64-bit integer, with ``prev_hash`` of the first chunk seeded from the model name, so
    equal prefixes give equal keys and any earlier difference changes every later key.

    ``scheme="lmcache"``: the hashes LMCache's ``ChunkedTokenDatabase`` gives for the same
    tokens and chunk size (:func:`lmcache_chunk_hash`, chained from 0), so keys match the
    ones an LMCache engine stored through the Persisting plugin. ``save_unfull_chunk``
    must be what LMCache's config says (False by default in 0.5.6, as here). The model name
    does not seed these hashes (it is in the key), and LMCache configured with vLLM's
    ``sha256_cbor`` hashes differently. LMCache's multiprocess mode hashes with its own
    (blake3) hasher into ``ObjectKey`` s: not this scheme.
    """

    def __init__(
        self,
        model: str,
        chunk_size: int = 256,
        world_size: int = 1,
        worker_id: int = 0,
        dtype: Any = "bfloat16",
        save_unfull_chunk: bool = False,
        tags: Sequence[tuple[str, str]] = (),
        scheme: HashScheme = "persisting",
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidKeyError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if scheme not in HASH_SCHEMES:
            raise InvalidKeyError(f"unknown hash scheme {scheme!r}; choose from {HASH_SCHEMES}")
        # Validates model, ranks, dtype and tags once, up front.
        self._template = ChunkKey(model, world_size, worker_id, 0, dtype, tuple(tags))
        self.model = model
        self.chunk_size = chunk_size
        self.world_size = world_size
        self.worker_id = worker_id
        #: The key dtype, spelled LMCache's way (``float32`` and ``torch.float32`` give
        #: ``float``).
        self.dtype = self._template.dtype
        #: The tags every key gets (``(name, value)`` pairs).
        self.tags = self._template.tags
        self.save_unfull_chunk = save_unfull_chunk
        self.scheme: HashScheme = scheme
        self._seed = xxhash.xxh3_64_intdigest(model.encode("utf-8"))

    def chunk_hashes(self, tokens: Iterable[int] | np.ndarray) -> list[tuple[int, int, int]]:
        """``(start, end, hash)`` per chunk; the last partial chunk only if saving it."""
        ids = token_ids(tokens)
        total = int(ids.shape[0])
        full_end = total - total % self.chunk_size
        end_limit = total if self.save_unfull_chunk else full_end
        if self.scheme == "lmcache":
            return self._lmcache_hashes(ids, total, end_limit)
        out: list[tuple[int, int, int]] = []
        prev = self._seed.to_bytes(8, "little", signed=False)
        for start in range(0, end_limit, self.chunk_size):
            end = min(start + self.chunk_size, total)
            digest = xxhash.xxh3_64_intdigest(prev + ids[start:end].tobytes())
            signed = digest - (1 << 64) if digest >= (1 << 63) else digest
            out.append((start, end, signed))
            prev = digest.to_bytes(8, "little", signed=False)
        return out

    def _lmcache_hashes(
        self, ids: np.ndarray, total: int, end_limit: int
    ) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        prefix = 0  # LMCache's NONE_HASH without vLLM
        values = ids.tolist()
        for start in range(0, end_limit, self.chunk_size):
            end = min(start + self.chunk_size, total)
            prefix = lmcache_chunk_hash(prefix, values[start:end])
            out.append((start, end, prefix))
        return out

    def process_tokens(self, tokens: Iterable[int] | np.ndarray) -> list[tuple[int, int, ChunkKey]]:
        """``(start, end, key)`` for each chunk of ``tokens``, in order."""
        t = self._template
        return [
            (start, end, ChunkKey(t.model, t.world_size, t.worker_id, h, t.dtype, t.tags))
            for start, end, h in self.chunk_hashes(tokens)
        ]

    def keys_for_rank(self, tokens: Iterable[int] | np.ndarray, worker_id: int) -> list[ChunkKey]:
        """The chunk keys of ``tokens`` as rank ``worker_id`` stores them."""
        return [key.with_worker(worker_id) for _s, _e, key in self.process_tokens(tokens)]


__all__ = [
    "HASH_SCHEMES",
    "KEY_DTYPES",
    "TORCH_DTYPE_NAMES",
    "AnyKey",
    "ChunkKey",
    "HashScheme",
    "LayerChunkKey",
    "TokenHasher",
    "key_dtype",
    "key_hash",
    "key_string",
    "lmcache_chunk_hash",
    "parse_key",
    "rank_keys",
]
