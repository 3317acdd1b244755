"""One behaviour suite for every implementation of the KV API contract (persisting.kv.api).

The checks are written once, against :class:`~persisting.kv.api.AsyncKVApi`; a blocking
implementation runs them through an adapter that awaits its methods in a worker thread
(:class:`Threaded`), and the in-process store through its own derived async mirror
(:class:`Mirrored`: ``aput``, ``aget``...). :func:`run_suite` runs every check, even after
one fails, and returns what each one said, so one run reports every divergence.

Each check uses keys from its own range above ``base``: several implementations may share
one server.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from persisting.errors import InvalidKeyError, InvalidValueError
from persisting.kv import ChunkKey, KVStore, Layout, TokenHasher
from persisting.kv.api import CONTRACT, KVApi

MODEL = "meta-llama/Llama-3-8B"
Check = Callable[[Any, int], Awaitable[None]]


def key(i: int, worker: int = 0, dtype: str = "bfloat16") -> ChunkKey:
    """Chunk ``i``'s key; ``dtype`` must be its value's (a put checks it)."""
    return ChunkKey(MODEL, 2 if worker else 1, worker, i * 104_729 - 7, dtype)


def tensor(seed: int, tokens: int = 16, hidden: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, tokens, hidden, generator=g).to(torch.bfloat16)


class Threaded:
    """A blocking implementation awaited: each contract method runs in a worker thread."""

    def __init__(self, api: KVApi):
        self.api = api

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name not in CONTRACT:
            raise AttributeError(name)
        method = getattr(self.api, name)
        return lambda *args, **kwargs: asyncio.to_thread(method, *args, **kwargs)


class Mirrored:
    """The in-process store through its derived async mirror (``put`` -> ``store.aput``)."""

    def __init__(self, store: KVStore):
        self.store = store

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name not in CONTRACT:
            raise AttributeError(name)
        method: Callable[..., Awaitable[Any]] = getattr(self.store, "a" + name)
        return method


def same(got: Any, want: Any) -> bool:
    """Bit-exact and of the same kind as was put."""
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        )
    if isinstance(want, np.ndarray):
        return (
            isinstance(got, np.ndarray)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and got.tobytes() == want.tobytes()
        )
    return isinstance(got, bytes | bytearray | memoryview) and bytes(got) == bytes(want)


async def raises(error: type[Exception], call: Awaitable[Any]) -> str:
    """The message of ``error`` that ``call`` raised (AssertionError if it raised no error
    or another one)."""
    try:
        result = await call
    except error as exc:
        return str(exc)
    raise AssertionError(f"expected {error.__name__}, got the result {result!r}")


# -- the checks ---------------------------------------------------------------------------


async def round_trip_is_bit_exact(api: Any, base: int) -> None:
    bf16 = tensor(base)
    array = np.arange(2 * 3 * 40 * 8, dtype=np.float32).reshape(2, 3, 40, 8) / 7
    raw = bytes(range(256)) * 300
    keys = [key(base), key(base + 1, dtype="float32"), key(base + 2)]
    results = [
        await api.put(keys[0], bf16),
        await api.put(keys[1], array),
        await api.put(keys[2], raw, fmt="binary"),
    ]
    assert [r.stored for r in results] == [True, True, True], results
    assert [r.key for r in results] == [k.to_string() for k in keys], results
    for i, want in enumerate((bf16, array, raw)):
        got = await api.get(keys[i])
        assert same(got, want), (i, type(got))
    again = await api.put(key(base), tensor(base + 999))  # content-addressed: a no-op
    assert again.stored is False, again
    assert same(await api.get(key(base)), bf16)


async def a_miss_is_none(api: Any, base: int) -> None:
    absent = key(base)
    assert await api.get(absent) is None
    assert await api.batched_get([absent, key(base + 1)]) == [None, None]
    assert await api.get_into(absent, torch.empty(16, dtype=torch.uint8)) is None
    assert await api.layout(absent) is None
    assert await api.contains(absent) is False
    assert await api.remove(absent) is False


async def batched_operations(api: Any, base: int) -> None:
    keys = [key(base + i) for i in range(4)]
    values = [tensor(base + i, tokens=8 * (i + 1)) for i in range(4)]
    parents = [None, *keys[:-1]]
    results = await api.batched_put(keys, values, parents=parents)
    assert [r.stored for r in results] == [True] * 4, results
    missing = key(base + 10)
    got = await api.batched_get([keys[0], missing, *keys[1:]])
    assert got[1] is None
    assert all(same(g, v) for g, v in zip([got[0], *got[2:]], values, strict=True))
    assert await api.batched_contains([*keys, missing]) == [True] * 4 + [False]
    assert await api.batched_contains([]) == []
    assert await api.batched_remove([keys[0], missing, keys[2]]) == 2
    assert await api.batched_contains(keys) == [False, True, False, True]
    assert await api.batched_get(keys[::2]) == [None, None]


async def contains_and_remove(api: Any, base: int) -> None:
    k = key(base)
    await api.put(k, tensor(base))
    assert await api.contains(k) is True
    assert await api.contains(k.to_string()) is True  # a key's string form is the same key
    assert await api.remove(k) is True
    assert await api.contains(k) is False
    assert await api.get(k) is None
    assert await api.remove(k) is False


async def get_into_fills_a_buffer_of_the_right_size(api: Any, base: int) -> None:
    value = tensor(base, tokens=32)
    k = key(base)
    await api.put(k, value)
    stored = await api.layout(k)
    assert stored == Layout.of(value, "KV_2LTD"), stored
    out = torch.empty_like(value)
    assert await api.get_into(k, out) == stored
    assert same(out, value)
    flat = np.zeros(value.numel() * 2, dtype=np.uint8)
    assert await api.get_into(k, flat, expect=stored) == stored
    assert flat.tobytes() == value.view(torch.uint8).numpy().tobytes()
    for size in (stored.nbytes - 2, stored.nbytes + 2, 10):
        wrong = np.full(size, 7, dtype=np.uint8)
        message = await raises(InvalidValueError, api.get_into(k, wrong))
        assert str(stored.nbytes) in message, message
        assert (wrong == 7).all(), "a refused buffer must be left as it was"
    await raises(InvalidValueError, api.get_into(k, bytes(stored.nbytes)))  # read-only
    other = Layout((2, 4, 16, 128), "bfloat16", "KV_2LTD", stored.nbytes)
    assert await api.get_into(k, out, expect=other) is None  # another layout: a miss
    assert await api.get(k, expect=other) is None
    assert same(await api.get(k, expect=stored), value)


async def lookup_prefix_stops_at_the_first_miss(api: Any, base: int) -> None:
    keys = [key(base + i) for i in range(5)]
    await api.batched_put(keys[:3], [tensor(base + i) for i in range(3)])
    assert await api.lookup_prefix(keys) == 3
    assert await api.lookup_prefix([keys[0], keys[4], keys[2]]) == 1
    assert await api.lookup_prefix(keys[3:]) == 0
    assert await api.lookup_prefix([]) == 0
    ranks = [[key(base + 20 + i, worker=w) for i in range(3)] for w in (0, 1)]
    await api.batched_put(ranks[0], [tensor(base + 20 + i) for i in range(3)])
    await api.batched_put(ranks[1][:2], [tensor(base + 30 + i) for i in range(2)])
    assert await api.lookup_prefix(ranks) == 2  # a chunk counts when every rank has it


async def lookup_tokens_counts_covered_tokens(api: Any, base: int) -> None:
    hasher = TokenHasher(MODEL, chunk_size=16)
    tokens = [(base * 31 + 7 * i) % 50_000 for i in range(56)]
    chunks = hasher.process_tokens(tokens)  # three full chunks; the unfull 8 are not hashed
    assert [end for _s, end, _k in chunks] == [16, 32, 48]
    await api.batched_put([k for _s, _e, k in chunks[:2]], [tensor(base), tensor(base + 1)])
    assert await api.lookup_tokens(tokens, hasher) == 32
    assert await api.lookup_tokens(np.asarray(tokens, dtype=np.int64), hasher=hasher) == 32
    assert await api.lookup_tokens([], hasher) == 0


async def a_malformed_key_is_an_invalid_key_error(api: Any, base: int) -> None:
    value = tensor(base)
    foreign = ChunkKey("mistralai/Mistral-7B", 1, 0, base, "bfloat16")
    for bad in ("not a key", "meta-llama/Llama-3-8B@1@0@nothex@bfloat16", foreign):
        await raises(InvalidKeyError, api.put(bad, value))
        await raises(InvalidKeyError, api.get(bad))
        await raises(InvalidKeyError, api.contains(bad))
        await raises(InvalidKeyError, api.lookup_prefix([bad]))
    await raises(InvalidKeyError, api.batched_put([key(base + 1), "junk"], [value, value]))
    assert await api.get(key(base + 1)) is None  # a refused batch stored nothing


async def pins_protect_from_a_gentle_remove(api: Any, base: int) -> None:
    k = key(base)
    await api.put(k, tensor(base))
    assert await api.pin(k) is True
    assert await api.remove(k, force=False) is False
    assert await api.contains(k) is True
    assert await api.unpin(k) is True
    assert await api.remove(k, force=False) is True
    assert await api.pin(key(base + 1)) is False  # nothing to pin


async def prefetch_and_stats(api: Any, base: int) -> None:
    k = key(base)
    await api.put(k, tensor(base))
    assert await api.prefetch([k, key(base + 1)]) == 1
    stats = await api.stats()
    assert stats["model"] == MODEL, stats


CHECKS: tuple[Check, ...] = (
    round_trip_is_bit_exact,
    a_miss_is_none,
    batched_operations,
    contains_and_remove,
    get_into_fills_a_buffer_of_the_right_size,
    lookup_prefix_stops_at_the_first_miss,
    lookup_tokens_counts_covered_tokens,
    a_malformed_key_is_an_invalid_key_error,
    pins_protect_from_a_gentle_remove,
    prefetch_and_stats,
)


async def run_suite(api: Any, base: int) -> dict[str, str]:
    """Every check against ``api``: ``{check: "ok" or what went wrong}``."""
    outcome: dict[str, str] = {}
    for i, check in enumerate(CHECKS):
        try:
            await check(api, base + 1000 * i)
            outcome[check.__name__] = "ok"
        except Exception as exc:
            lines = [
                f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__
            ]
            outcome[check.__name__] = f"{type(exc).__name__} at line {lines[-1]}: {exc}"
    return outcome
