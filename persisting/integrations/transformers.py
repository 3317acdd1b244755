"""Save and restore a transformers ``DynamicCache`` prefix in a Persisting KV store.

    n, cache = load_prefix(store, ids, num_kv_heads=8, dtype=torch.bfloat16, device="cuda")
    logits, cache = forward(model, ids[:, n:], cache)        # prefill only the rest
    save_prefix(store, ids, cache)                            # store what is new

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
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from persisting.cuda import DeviceCopier, shared_copier
from persisting.errors import InvalidValueError
from persisting.kv.keys import KEY_DTYPES, ChunkKey, TokenHasher
from persisting.kv.layout import Layout, torch_dtype

FORMAT = "KV_2LTD"


def dtype_name(dtype: Any) -> str:
    """The name keys and layouts give a torch dtype (``bfloat16``, ``half``, ``float``...)."""
    for name in KEY_DTYPES:
        try:
            if torch_dtype(name) == dtype:
                return name
        except InvalidValueError:
            continue
    raise InvalidValueError(f"KV caches of dtype {dtype} cannot be stored")


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
        return hasher
    model = getattr(store, "model", None)
    chunk_size = getattr(store, "chunk_size", None)
    if not isinstance(model, str) or not isinstance(chunk_size, int):
        raise InvalidValueError(f"{type(store).__name__} has no model/chunk_size: pass hasher=")
    return TokenHasher(model, chunk_size=chunk_size, dtype=dtype)


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
    already stored are not copied again (a lookup first).
    """
    import torch

    layers = _layers(past_key_values)
    first = layers[0][0]
    covered = min(int(k.shape[2]) for k, _ in layers)
    hasher = _hasher(store, hasher, dtype_name(first.dtype))
    chunks = hasher.process_tokens(_token_ids(tokens)[:covered])
    if not chunks:
        return 0
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
    num_kv_heads: int,
    dtype: Any,
    device: Any = "cpu",
    max_tokens: int | None = None,
    hasher: TokenHasher | None = None,
    copier: DeviceCopier | None = None,
    cache: Any = None,
) -> tuple[int, Any]:
    """Restore the longest stored prefix of ``tokens`` (at most ``max_tokens``, e.g. one
    less than the prompt so the model has a token left to compute, or what
    :func:`~persisting.kv.load_plan.plan_load` says is worth loading).

    Returns ``(n_tokens, cache)``: the KV of the first ``n_tokens`` tokens in ``cache`` (a
    new ``DynamicCache`` unless one is given) on ``device``. A chunk that turns out to be
    missing, damaged or laid out differently ends the prefix there; nothing after it is
    used. ``num_kv_heads`` and ``dtype`` are the model's (``config.num_key_value_heads``,
    ``model.dtype``).
    """
    import torch
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache()
    hasher = _hasher(store, hasher, dtype_name(dtype))
    chunks = hasher.process_tokens(_token_ids(tokens))
    if max_tokens is not None:
        chunks = [c for c in chunks if c[1] <= max_tokens]
    hits = store.lookup_prefix([key for _s, _e, key in chunks]) if chunks else 0
    chunks = chunks[:hits]
    stored = store.layout(chunks[0][2]) if chunks else None
    if stored is None or not _loadable(stored, num_kv_heads, dtype):
        return 0, cache
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


def _loadable(layout: Layout, num_kv_heads: int, dtype: Any) -> bool:
    shape = layout.shape
    return (
        layout.fmt == FORMAT
        and len(shape) == 4
        and shape[0] == 2
        and num_kv_heads > 0
        and shape[3] % num_kv_heads == 0
        and layout.dtype == dtype_name(dtype)
    )


def _cache_argument(model: Any) -> str:
    """The name ``model.forward`` takes its KV cache by in this transformers release."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model: Any, input_ids: Any, cache: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """``model(input_ids)`` continuing ``cache`` (which it extends in place): (logits, cache),
    in any transformers 5.x release."""
    kwargs[_cache_argument(model)] = cache
    out = model(input_ids=input_ids, use_cache=True, **kwargs)
    new_cache = out.get("cache")
    if new_cache is None:
        new_cache = out.get("past_key_values")
    return out.logits, new_cache


__all__: Sequence[str] = [
    "FORMAT",
    "cache_from_chunks",
    "dtype_name",
    "forward",
    "load_prefix",
    "save_prefix",
]
