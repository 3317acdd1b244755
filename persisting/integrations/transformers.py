"""Save and restore a transformers ``DynamicCache`` prefix in a Persisting KV store.

    n, cache = load_prefix(store, ids, model=model, device="cuda", max_tokens=len(ids) - 1)
    logits, cache = forward(model, ids[:, n:], cache)        # prefill only the rest
    save_prefix(store, ids, cache)                            # store what is new

Keys carry the KV dtype (``...@float`` for a float32 model): ``save_prefix`` sets the
store's :attr:`~persisting.kv.KVStore.key_dtype` to the cache's, so the store's own
``lookup_tokens``/``plan_tokens`` find what it saved; in another process, pass
``dtype=`` (or set ``kv.key_dtype``).

What a restore is checked against, so a mismatch is a
:class:`~persisting.errors.LayoutMismatchError` and never a cache: the geometry
``save_prefix`` records beside the chunks (KV heads, head size, layers; one small record
per model and dtype), and the model restored into (``model=``: its config's KV heads,
head size and layers). :func:`forward` checks a cache against the model too, and refuses a
prompt with nothing left to compute.

Each chunk of ``chunk_size`` tokens is one ``KV_2LTD`` value, ``[2, layers, tokens,
kv_heads * head_dim]`` (LMCache's layout), under the prefix-chained key
:class:`~persisting.kv.TokenHasher` gives it, so equal prefixes share chunks and a lookup
stops at the first chunk that differs. The store may be a :class:`~persisting.kv.KVStore`
or anything with its ``lookup_prefix``, ``batched_put``, ``layout`` and ``get_into``
methods (the service's ``SyncKVCacheClient`` for one; pass ``hasher=`` when the object has
no ``model``/``chunk_size`` attributes).

Device data goes through :mod:`persisting.cuda`: a save copies each chunk down into pinned
memory on a side stream; a load reads each chunk into a pinned staging buffer and sends it
up while the next chunk is read. One sequence (batch size 1) at a time; caches of
sliding-window layers, which do not hold the whole prefix, are refused.

Works with transformers 5.x (``cache.layers[i].keys``). :func:`forward` hides the one
difference between 5.x releases a caller meets: the cache argument of ``forward`` is
``past_key_values`` in earlier 5.x releases, ``cache`` in later ones.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from persisting.cuda import DeviceCopier, shared_copier
from persisting.errors import InvalidKeyError, InvalidValueError, LayoutMismatchError
from persisting.kv.keys import KEY_DTYPES, TORCH_DTYPE_NAMES, ChunkKey, TokenHasher, key_dtype
from persisting.kv.layout import Layout, torch_dtype

FORMAT = "KV_2LTD"
#: The tag of the geometry record's key (no token chunk key has tags of its own).
GEOMETRY_TAG = ("persisting", "kv-geometry")
_GEOMETRY_HASH = xxhash.xxh3_64_intdigest(b"persisting/transformers kv geometry") >> 1


def dtype_name(dtype: Any) -> str:
    """The name keys and layouts give a KV dtype (``bfloat16``, ``half``, ``float``...):
    of a ``torch.dtype``, or of a name (torch's, ``"float32"``, or LMCache's)."""
    try:
        name = key_dtype(dtype)
        torch_dtype(name)  # a dtype torch has (every key dtype but those it lacks)
    except (InvalidKeyError, InvalidValueError):
        supported = ", ".join(sorted({*TORCH_DTYPE_NAMES, *KEY_DTYPES} - {"bool"}))
        raise InvalidValueError(
            f"KV caches of dtype {dtype} cannot be stored; supported: {supported}"
        ) from None
    return name


def _torch_dtype(dtype: Any) -> Any:
    """A torch dtype from a ``torch.dtype`` or any name :func:`dtype_name` takes."""
    return torch_dtype(dtype_name(dtype))


@dataclass(frozen=True)
class Geometry:
    """The shape of a model's KV cache: what a stored prefix must match to be restored."""

    num_kv_heads: int
    head_dim: int
    num_layers: int

    def describe(self) -> str:
        return f"{self.num_kv_heads} KV heads of {self.head_dim}, {self.num_layers} layer(s)"

    @classmethod
    def of_model(cls, model: Any) -> Geometry:
        """A transformers model's (or config's) KV geometry, from its config."""
        config = getattr(model, "config", model)
        text = getattr(config, "get_text_config", None)
        config = text() if callable(text) else config
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None)
        if not head_dim and heads:
            head_dim = int(config.hidden_size) // int(heads)
        layers = getattr(config, "num_hidden_layers", None)
        if not (kv_heads and head_dim and layers):
            raise InvalidValueError(
                f"cannot read the KV geometry of {type(model).__name__}: its config needs "
                "num_key_value_heads (or num_attention_heads), head_dim (or hidden_size) "
                "and num_hidden_layers"
            )
        return cls(int(kv_heads), int(head_dim), int(layers))


def _token_ids(tokens: Any) -> np.ndarray:
    """A flat int64 array of token ids from a list, an array or a (batch-1) tensor."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise InvalidValueError(f"tokens must be one sequence, got shape {list(ids.shape)}")
    return ids


def _hasher(store: Any, hasher: TokenHasher | None, dtype: str) -> TokenHasher:
    if hasher is not None:
        if hasher.dtype != dtype:
            raise InvalidValueError(
                f"the hasher keys chunks as {hasher.dtype} but the KV cache is {dtype}: "
                f"make it with TokenHasher(..., dtype={dtype!r})"
            )
        return hasher
    model = getattr(store, "model", None)
    chunk_size = getattr(store, "chunk_size", None)
    if not isinstance(model, str) or not isinstance(chunk_size, int):
        raise InvalidValueError(f"{type(store).__name__} has no model/chunk_size: pass hasher=")
    return TokenHasher(model, chunk_size=chunk_size, dtype=dtype)


def _geometry_key(hasher: TokenHasher) -> ChunkKey:
    """Where the geometry of ``hasher``'s model and dtype is recorded: a key of that model,
    rank and dtype with a tag no token chunk carries."""
    return ChunkKey(
        hasher.model,
        hasher.world_size,
        hasher.worker_id,
        _GEOMETRY_HASH,
        hasher.dtype,
        (*hasher.tags, GEOMETRY_TAG),
    )


def saved_geometry(store: Any, hasher: TokenHasher) -> Geometry | None:
    """The geometry recorded for ``hasher``'s model and dtype, or None (none saved yet, or
    saved before records were kept)."""
    key = _geometry_key(hasher)
    layout = store.layout(key)
    if layout is None or layout.nbytes > 4096:
        return None
    buffer = bytearray(layout.nbytes)
    if store.get_into(key, buffer) is None:
        return None
    try:
        data = json.loads(bytes(buffer))
        return Geometry(int(data["num_kv_heads"]), int(data["head_dim"]), int(data["num_layers"]))
    except (ValueError, KeyError, TypeError):
        return None


def _record_geometry(store: Any, hasher: TokenHasher, geometry: Geometry) -> None:
    """Record ``geometry`` for the model and dtype, or refuse a cache of another one."""
    saved = saved_geometry(store, hasher)
    if saved is not None and saved != geometry:
        raise LayoutMismatchError(
            f"{hasher.model!r} ({hasher.dtype}) holds KV caches of {saved.describe()}; this "
            f"cache has {geometry.describe()}: another model under the same name?"
        )
    if saved is None:
        record = json.dumps(geometry.__dict__, sort_keys=True).encode()
        store.put(_geometry_key(hasher), record, fmt="binary")


def _layers(cache: Any) -> list[tuple[Any, Any]]:
    """(keys, values) per layer, each ``[1, kv_heads, tokens, head_dim]``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(layer.keys, layer.values) for layer in layers]
    elif isinstance(cache, list | tuple):
        pairs = [(entry[0], entry[1]) for entry in cache]  # the legacy tuple format
    else:
        raise InvalidValueError(f"not a KV cache: {type(cache).__name__}")
    if not pairs or any(k is None or v is None for k, v in pairs):
        raise InvalidValueError("the cache holds no keys and values (yet)")
    shape = tuple(pairs[0][0].shape)
    if len(shape) != 4 or shape[0] != 1:
        raise InvalidValueError(f"want [1, heads, tokens, head_dim] per layer, got {list(shape)}")
    for k, v in pairs:
        if k.shape[:2] != shape[:2] or k.shape[3] != shape[3] or k.shape != v.shape:
            raise InvalidValueError("layers of different head counts or sizes cannot be stored")
        if k.dtype != pairs[0][0].dtype or k.device != pairs[0][0].device:
            raise InvalidValueError("every layer must have the same dtype and device")
    for layer in layers or ():
        if getattr(layer, "is_sliding", False):
            raise InvalidValueError("sliding-window layers do not hold the whole prefix")
    return pairs


def _chunk_kv(layers: list[tuple[Any, Any]], start: int, end: int) -> Any:
    """Chunk ``[start, end)`` as ``[2, layers, tokens, heads, head_dim]`` (a strided view of
    one stacked copy: the copier makes it contiguous on the device)."""
    import torch

    keys = torch.stack([k[0, :, start:end] for k, _ in layers])
    values = torch.stack([v[0, :, start:end] for _, v in layers])
    return torch.stack([keys, values]).transpose(2, 3)


def save_prefix(
    store: Any,
    tokens: Any,
    past_key_values: Any,
    *,
    hasher: TokenHasher | None = None,
    copier: DeviceCopier | None = None,
) -> int:
    """Store the chunks of ``tokens`` that ``past_key_values`` covers and the store lacks;
    returns how many leading tokens the store now holds.

    Only whole chunks are stored unless ``hasher`` saves the last partial one. Chunks
    already stored are not copied again (a lookup first). The cache's geometry (KV heads,
    head size, layers) is recorded for its model and dtype, and a cache of another
    geometry under the same model name is a LayoutMismatchError. The store's
    ``key_dtype`` becomes the cache's dtype, so ``store.lookup_tokens(tokens)`` finds
    these chunks.
    """
    import torch

    layers = _layers(past_key_values)
    first = layers[0][0]
    covered = min(int(k.shape[2]) for k, _ in layers)
    hasher = _hasher(store, hasher, dtype_name(first.dtype))
    chunks = hasher.process_tokens(_token_ids(tokens)[:covered])
    if not chunks:
        return 0
    geometry = Geometry(int(first.shape[1]), int(first.shape[3]), len(layers))
    _record_geometry(store, hasher, geometry)
    if getattr(store, "key_dtype", None) is not None:
        store.key_dtype = hasher.dtype  # the store's own token lookups find these chunks
    keys = [key for _s, _e, key in chunks]
    present = store.lookup_prefix(keys)
    todo = chunks[present:]
    parents: list[ChunkKey | None] = [None, *keys[:-1]]
    n_layers, heads, head_dim = len(layers), int(first.shape[1]), int(first.shape[3])

    def shape(start: int, end: int) -> tuple[int, int, int, int]:
        return (2, n_layers, end - start, heads * head_dim)

    views = (_chunk_kv(layers, s, e) for s, e, _k in todo)
    values: Iterator[Any]
    limit = 64 << 20
    if first.device.type == "cuda":
        copier = copier or shared_copier(first.device)
        if copier.staging is not None:
            limit = copier.staging.capacity // 2  # batches must leave the ring room to flow
        values = (
            torch.from_numpy(buffer).view(first.dtype).view(shape(s, e))
            for buffer, (s, e, _k) in zip(copier.to_host(views), todo, strict=True)
        )
    else:
        values = (
            v.contiguous().view(shape(s, e)) for v, (s, e, _k) in zip(views, todo, strict=True)
        )
    batch: list[tuple[ChunkKey, Any, ChunkKey | None]] = []
    batch_bytes = 0
    for i, value in enumerate(values, start=present):
        batch.append((keys[i], value, parents[i]))
        batch_bytes += value.numel() * value.element_size()
        if batch_bytes >= limit or i == len(chunks) - 1:
            store.batched_put(
                [b[0] for b in batch],
                [b[1] for b in batch],
                fmt=FORMAT,
                parents=[b[2] for b in batch],
            )
            batch, batch_bytes = [], 0
    stored = store.lookup_prefix(keys)
    return chunks[stored - 1][1] if stored else 0


def _read_chunk(store: Any, key: ChunkKey, expect: Layout, buffer: np.ndarray) -> bool:
    return store.get_into(key, buffer, expect=expect) is not None


def load_prefix(
    store: Any,
    tokens: Any,
    *,
    num_kv_heads: int | None = None,
    dtype: Any = None,
    model: Any = None,
    device: Any = "cpu",
    max_tokens: int | None = None,
    hasher: TokenHasher | None = None,
    copier: DeviceCopier | None = None,
    cache: Any = None,
) -> tuple[int, Any]:
    """Restore the longest stored prefix of ``tokens`` (at most ``max_tokens``, e.g. one
    less than the prompt so the model has a token left to compute, or what
    :func:`~persisting.kv.paths.load_plan.plan_load` says is worth loading).

    Returns ``(n_tokens, cache)``: the KV of the first ``n_tokens`` tokens in ``cache`` (a
    new ``DynamicCache`` unless one is given) on ``device``. A chunk that turns out to be
    missing, damaged or laid out differently ends the prefix there; nothing after it is
    used.

    ``model`` is the model restored into: its config gives the KV heads, head size and
    layers the stored prefix must have, and its dtype the default ``dtype``. Without it,
    give ``num_kv_heads`` (``config.num_key_value_heads``) and ``dtype`` (``model.dtype``,
    or a name: ``"float32"``). A prefix saved with another geometry -- per the record
    :func:`save_prefix` keeps, the model's config, or a chunk's shape -- is a
    LayoutMismatchError, never a cache.
    """
    import torch
    from transformers import DynamicCache

    expected = Geometry.of_model(model) if model is not None else None
    if num_kv_heads is None:
        if expected is None:
            raise InvalidValueError("pass model= (the model restored into), or num_kv_heads=")
        num_kv_heads = expected.num_kv_heads
    elif expected is not None and num_kv_heads != expected.num_kv_heads:
        raise LayoutMismatchError(
            f"num_kv_heads={num_kv_heads}, but the model restored into has "
            f"{expected.num_kv_heads} KV heads"
        ).about("num_kv_heads")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise InvalidValueError(f"num_kv_heads must be a positive int, not {num_kv_heads!r}")
    if dtype is None:
        if model is None or getattr(model, "dtype", None) is None:
            raise InvalidValueError("pass dtype= (the model's KV dtype), or model=")
        dtype = model.dtype
    name = dtype_name(dtype)
    dtype = _torch_dtype(name)
    cache = cache if cache is not None else DynamicCache()
    hasher = _hasher(store, hasher, name)
    chunks = hasher.process_tokens(_token_ids(tokens))
    if max_tokens is not None:
        chunks = [c for c in chunks if c[1] <= max_tokens]
    hits = store.lookup_prefix([key for _s, _e, key in chunks]) if chunks else 0
    chunks = chunks[:hits]
    stored = store.layout(chunks[0][2]) if chunks else None
    if stored is None or not _is_chunk(stored, name):
        return 0, cache
    _check_geometry(stored, num_kv_heads, expected, saved_geometry(store, hasher))
    n_layers, hidden = stored.shape[1], stored.shape[3]
    element = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod((2, n_layers, e - s, hidden)) for s, e, _k in chunks]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    outs, reads = [], []
    offset = 0
    for (start, end, key), size in zip(chunks, sizes, strict=True):
        shape = (2, n_layers, end - start, hidden)
        outs.append(flat[offset : offset + size].view(shape))
        offset += size
        expect = Layout(shape, stored.dtype, FORMAT, size * element)
        reads.append(functools.partial(_read_chunk, store, key, expect))
    copier = copier or shared_copier(flat.device)
    done = copier.upload(reads, outs)
    loaded = done.index(False) if False in done else len(done)
    if loaded == 0:
        return 0, cache
    return chunks[loaded - 1][1], cache_from_chunks(outs[:loaded], num_kv_heads, cache)


def _is_chunk(layout: Layout, dtype: str) -> bool:
    """Whether ``layout`` is a bridge chunk of ``dtype`` at all (else: nothing to restore)."""
    shape = layout.shape
    return layout.fmt == FORMAT and len(shape) == 4 and shape[0] == 2 and layout.dtype == dtype


def _check_geometry(
    layout: Layout, num_kv_heads: int, model: Geometry | None, saved: Geometry | None
) -> None:
    """LayoutMismatchError unless the stored chunk, what was saved, the model restored into
    and ``num_kv_heads`` agree on KV heads, head size and layers."""
    layers, hidden = layout.shape[1], layout.shape[3]
    problems = []
    if saved is not None:
        if saved.num_kv_heads != num_kv_heads:
            problems.append(f"it was saved with {saved.describe()}, not {num_kv_heads} KV heads")
        if model is not None and saved != model:
            problems.append(
                f"it was saved with {saved.describe()}; the model has {model.describe()}"
            )
    if model is not None:
        if layers != model.num_layers:
            problems.append(f"its chunks hold {layers} layer(s); the model has {model.num_layers}")
        if hidden != model.num_kv_heads * model.head_dim:
            problems.append(
                f"its chunks hold {hidden} values per token and layer; the model's "
                f"{model.num_kv_heads} KV heads of {model.head_dim} make "
                f"{model.num_kv_heads * model.head_dim}"
            )
    if hidden % num_kv_heads:
        problems.append(
            f"{hidden} values per token and layer do not split into {num_kv_heads} heads"
        )
    if problems:
        raise LayoutMismatchError(
            "the stored prefix does not fit: " + "; ".join(dict.fromkeys(problems))
        ).about("num_kv_heads")


def cache_from_chunks(chunks: Sequence[Any], num_kv_heads: int, cache: Any = None) -> Any:
    """A ``DynamicCache`` (``cache`` if given, extended) holding the consecutive
    ``[2, layers, tokens, kv_heads * head_dim]`` chunk tensors ``chunks``, on their device."""
    import torch
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache()
    n_layers, hidden = chunks[0].shape[1], chunks[0].shape[3]
    n_tokens = sum(int(c.shape[2]) for c in chunks)
    head_dim = hidden // num_kv_heads
    for layer in range(n_layers):
        kv = [torch.cat([c[i, layer] for c in chunks]) for i in (0, 1)]
        k, v = (t.view(n_tokens, num_kv_heads, head_dim).transpose(0, 1).unsqueeze(0) for t in kv)
        cache.update(k, v, layer)
    return cache


def _cache_argument(model: Any) -> str:
    """The name ``model.forward`` takes its KV cache by in this transformers release."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model: Any, input_ids: Any, cache: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """``model(input_ids)`` continuing ``cache`` (which it extends in place): (logits, cache),
    in any transformers 5.x release.

    Refused with a clear error before the model runs: ``input_ids`` with no token (the
    cache covers the whole prompt: restore at most ``len(prompt) - 1`` tokens), and a
    cache whose KV heads, head size or layer count are not the model's
    (LayoutMismatchError).
    """
    if int(input_ids.shape[-1]) == 0:
        raise InvalidValueError(
            "nothing left to compute: the restored cache covers the whole prompt; restore "
            "with load_prefix(..., max_tokens=len(prompt) - 1) so the model has a token "
            "to compute the next logits from"
        )
    if cache is not None and getattr(cache, "layers", None):
        _check_cache(model, cache)
    kwargs[_cache_argument(model)] = cache
    out = model(input_ids=input_ids, use_cache=True, **kwargs)
    new_cache = out.get("cache")
    if new_cache is None:
        new_cache = out.get("past_key_values")
    return out.logits, new_cache


def _check_cache(model: Any, cache: Any) -> None:
    """LayoutMismatchError unless ``cache``'s layers have the model's KV geometry."""
    try:
        expected = Geometry.of_model(model)
    except InvalidValueError:
        return  # not a config we can read: transformers will say what it finds
    filled = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    if not filled:
        return
    shape = tuple(filled[0].keys.shape)
    found = Geometry(int(shape[1]), int(shape[3]), len(cache.layers)) if len(shape) == 4 else None
    if found is not None and found != expected:
        raise LayoutMismatchError(
            f"the cache holds {found.describe()}; the model has {expected.describe()}"
        )


__all__: Sequence[str] = [
    "FORMAT",
    "Geometry",
    "cache_from_chunks",
    "dtype_name",
    "forward",
    "load_prefix",
    "save_prefix",
    "saved_geometry",
]
