"""Request traces for the replay benchmark: a JSONL format and a synthetic generator.

Prefix caching pays off when many requests share long prefixes (a system prompt, a popular
document) and each adds its own suffix (the question). The generator makes exactly that
workload — document popularity follows a Zipf law, every request carries a unique suffix,
arrivals come at a set rate — deterministically from a seed, so two runs replay the same
requests.

Trace format (JSONL, UTF-8, one JSON object per line)::

    {"format": "persisting-trace", "version": 1, "model": "bench/model",
     "vocab_size": 32000, "generator": {...} or null}
    {"id": "q0-0", "t": 0.0, "doc": 3,
     "segments": [{"id": "system", "tokens": 64}, {"id": "doc-3", "tokens": 2048},
                  {"id": "q0-0", "tokens": 128}]}
    {"id": "r2", "t": 0.5, "tokens": [101, 2023, 318]}

* The first line is the header. ``model`` names the KV namespace the trace is replayed
  into; ``vocab_size`` bounds generated token ids; ``generator`` records the parameters a
  synthetic trace was made with (``null`` for recorded traces).
* Every other line is one request: ``id`` (unique string), ``t`` (arrival time in seconds
  from the start, non-decreasing), and its prompt either as explicit ``tokens`` or as
  ``segments``. A segment is the first ``tokens`` ids of a deterministic pseudo-random
  stream named by ``id`` (seeded by xxh3 of the id), so equal segment ids give equal token
  ids in every process, and a shorter use of a segment is a prefix of a longer one. The
  prompt is the segments' tokens concatenated. Extra fields (``doc``...) are kept as
  ``meta`` and ignored by the replay.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

from persisting.errors import InvalidValueError

TRACE_FORMAT = "persisting-trace"
TRACE_VERSION = 1

Arrival = Literal["poisson", "uniform"]


@dataclass(frozen=True)
class Segment:
    """A named run of tokens shared by every request that names it."""

    id: str
    tokens: int


@dataclass(frozen=True)
class TraceRequest:
    """One prompt arriving at ``t`` seconds, given by segments or by explicit token ids."""

    id: str
    t: float
    segments: tuple[Segment, ...] = ()
    tokens: tuple[int, ...] | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_tokens(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        return sum(s.tokens for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "t": self.t, **self.meta}
        if self.tokens is not None:
            out["tokens"] = list(self.tokens)
        else:
            out["segments"] = [asdict(s) for s in self.segments]
        return out


@dataclass(frozen=True)
class TraceHeader:
    """What a trace is for: the model namespace, the token id range, how it was made."""

    model: str
    vocab_size: int = 32000
    generator: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "model": self.model,
            "vocab_size": self.vocab_size,
            "generator": self.generator,
        }


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t if self.requests else 0.0


@dataclass(frozen=True)
class TraceSpec:
    """Parameters of a synthetic trace (all recorded in the header's ``generator``).

    ``documents`` distinct document prefixes of ``doc_tokens`` tokens each are drawn with
    probability proportional to ``1 / rank ** zipf_s``; each request is the shared
    ``system_tokens`` prompt, one document and ``suffix_tokens`` tokens of its own.
    Arrivals come at ``rate`` requests/s, Poisson (exponential gaps) or evenly spaced.
    """

    requests: int = 200
    rate: float = 20.0
    arrival: Arrival = "poisson"
    documents: int = 50
    zipf_s: float = 1.0
    doc_tokens: int = 2048
    suffix_tokens: int = 256
    system_tokens: int = 0
    seed: int = 0
    model: str = "bench/synthetic"
    vocab_size: int = 32000

    def validate(self) -> None:
        checks = (
            (self.requests >= 1, "requests", "requests must be >= 1"),
            (self.rate > 0, "rate", "rate must be > 0 requests/s"),
            (
                self.arrival in ("poisson", "uniform"),
                "arrival",
                "arrival must be 'poisson' or 'uniform'",
            ),
            (self.documents >= 1, "documents", "documents must be >= 1"),
            (self.zipf_s >= 0, "zipf_s", "zipf_s must be >= 0 (0 is uniform popularity)"),
            (self.doc_tokens >= 0, "doc_tokens", "doc_tokens must be >= 0"),
            (self.suffix_tokens >= 0, "suffix_tokens", "suffix_tokens must be >= 0"),
            (self.system_tokens >= 0, "system_tokens", "system_tokens must be >= 0"),
            (self.vocab_size >= 2, "vocab_size", "vocab_size must be >= 2"),
            (
                self.doc_tokens + self.suffix_tokens + self.system_tokens >= 1,
                "doc_tokens",
                "a request needs at least one token",
            ),
            (bool(self.model), "model", "model must be a non-empty name"),
        )
        for ok, name, message in checks:
            if not ok:
                raise InvalidValueError(f"trace spec: {message}").about(name)


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Probabilities of ranks 1..n under a finite Zipf law with exponent ``s``."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def generate_trace(spec: TraceSpec) -> Trace:
    """A deterministic synthetic trace: Zipf-popular shared documents, unique suffixes."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    docs = rng.choice(
        spec.documents, size=spec.requests, p=zipf_weights(spec.documents, spec.zipf_s)
    )
    if spec.arrival == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, size=spec.requests)
        gaps[0] = 0.0
        times = np.cumsum(gaps)
    else:
        times = np.arange(spec.requests, dtype=np.float64) / spec.rate
    requests = []
    for i, (doc, t) in enumerate(zip(docs.tolist(), times.tolist(), strict=True)):
        request_id = f"q{spec.seed}-{i}"
        segments = [
            Segment("system", spec.system_tokens),
            Segment(f"doc-{doc}", spec.doc_tokens),
            Segment(request_id, spec.suffix_tokens),
        ]
        requests.append(
            TraceRequest(
                id=request_id,
                t=round(t, 6),
                segments=tuple(s for s in segments if s.tokens > 0),
                meta={"doc": doc},
            )
        )
    header = TraceHeader(model=spec.model, vocab_size=spec.vocab_size, generator=asdict(spec))
    return Trace(header=header, requests=tuple(requests))


class SegmentTokens:
    """Token ids of named segments, kept for the most recently used segments."""

    def __init__(self, vocab_size: int, max_cached: int = 4096) -> None:
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def segment(self, segment: Segment) -> np.ndarray:
        ids = self._cache.get(segment.id)
        if ids is None or len(ids) < segment.tokens:
            seed = xxhash.xxh3_64_intdigest(segment.id.encode("utf-8"))
            rng = np.random.Generator(np.random.PCG64(seed))
            ids = rng.integers(0, self.vocab_size, size=segment.tokens, dtype=np.int64)
            self._cache[segment.id] = ids
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        self._cache.move_to_end(segment.id)
        return ids[: segment.tokens]

    def prompt(self, request: TraceRequest) -> np.ndarray:
        """The request's token ids, from explicit tokens or its segments."""
        if request.tokens is not None:
            return np.asarray(request.tokens, dtype=np.int64)
        if not request.segments:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.segment(s) for s in request.segments])


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as JSONL (header line first)."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(trace.header.to_json()) + "\n")
        for request in trace.requests:
            f.write(json.dumps(request.to_json(), separators=(",", ":")) + "\n")
    return path


def read_trace(path: str | Path) -> Trace:
    """Read and validate a JSONL trace; a malformed one raises InvalidValueError."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            lines = list(_json_lines(f, path))
    except OSError as exc:
        raise InvalidValueError(f"cannot read trace {path}: {exc}") from exc
    if not lines:
        raise InvalidValueError(f"{path}: empty trace (no header line)")
    header = _parse_header(lines[0][1], f"{path}:{lines[0][0]}")
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    last_t = 0.0
    for lineno, obj in lines[1:]:
        where = f"{path}:{lineno}"
        request = _parse_request(obj, where)
        if request.id in seen:
            raise InvalidValueError(f"{where}: duplicate request id {request.id!r}")
        if request.t < last_t:
            raise InvalidValueError(
                f"{where}: arrival time goes backwards ({request.t} < {last_t})"
            )
        if request.tokens is not None and any(tok >= header.vocab_size for tok in request.tokens):
            raise InvalidValueError(f"{where}: token id >= vocab_size {header.vocab_size}")
        seen.add(request.id)
        last_t = request.t
        requests.append(request)
    return Trace(header=header, requests=tuple(requests))


def _json_lines(lines: Iterable[str], path: Path) -> Iterator[tuple[int, Any]]:
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc


def _parse_header(obj: Any, where: str) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
        raise InvalidValueError(f"{where}: first line must be a {TRACE_FORMAT!r} header")
    if obj.get("version") != TRACE_VERSION:
        raise InvalidValueError(f"{where}: unsupported trace version {obj.get('version')!r}")
    model = obj.get("model")
    vocab = obj.get("vocab_size", 32000)
    generator = obj.get("generator")
    if not isinstance(model, str) or not model:
        raise InvalidValueError(f"{where}: header needs a non-empty 'model'")
    if not is_int(vocab) or vocab < 2:
        raise InvalidValueError(f"{where}: 'vocab_size' must be an integer >= 2")
    if generator is not None and not isinstance(generator, dict):
        raise InvalidValueError(f"{where}: 'generator' must be an object or null")
    return TraceHeader(model=model, vocab_size=vocab, generator=generator)


def _parse_request(obj: Any, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise InvalidValueError(f"{where}: a request must be a JSON object")
    request_id, t = obj.get("id"), obj.get("t")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidValueError(f"{where}: request needs a non-empty string 'id'")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
        raise InvalidValueError(f"{where}: 't' must be a finite number of seconds >= 0")
    has_tokens, has_segments = "tokens" in obj, "segments" in obj
    if has_tokens == has_segments:
        raise InvalidValueError(f"{where}: give exactly one of 'tokens' or 'segments'")
    meta = {k: v for k, v in obj.items() if k not in ("id", "t", "tokens", "segments")}
    if has_tokens:
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not all(is_int(x) and x >= 0 for x in tokens):
            raise InvalidValueError(f"{where}: 'tokens' must be a list of token ids >= 0")
        return TraceRequest(id=request_id, t=float(t), tokens=tuple(tokens), meta=meta)
    segments = obj["segments"]
    if not isinstance(segments, list):
        raise InvalidValueError(f"{where}: 'segments' must be a list")
    parsed = []
    for seg in segments:
        if (
            not isinstance(seg, dict)
            or not isinstance(seg.get("id"), str)
            or not seg["id"]
            or not is_int(seg.get("tokens"))
            or seg["tokens"] < 0
        ):
            raise InvalidValueError(f"{where}: a segment is {{'id': str, 'tokens': int >= 0}}")
        parsed.append(Segment(seg["id"], seg["tokens"]))
    return TraceRequest(id=request_id, t=float(t), segments=tuple(parsed), meta=meta)


def is_int(value: Any) -> bool:
    """Whether a parsed JSON value is an integer (``true`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Segment",
    "SegmentTokens",
    "Trace",
    "TraceHeader",
    "TraceRequest",
    "TraceSpec",
    "generate_trace",
    "read_trace",
    "write_trace",
    "zipf_weights",
]
