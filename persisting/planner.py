"""Capacity and bandwidth budget of a shared KV-cache tier, worked exactly.

Operators size a KV tier before they buy memory, disks and NICs. This module does the
arithmetic of that budget (the template of seed 004, sections 1.2-1.3) with exact rational
numbers, so the figures an operator checks by hand come out to the byte.

Rounding rules (the only places a result can be inexact):

* Inputs that may be fractional (``fill``, ``rps``, ``new_prefix_fraction``, ``staging_ms``,
  ``nic_gbps``, ``nic_efficiency``) are read as the decimal the user typed (``0.7`` is 7/10,
  not the nearest binary float), so every result is computed as an exact fraction.
* Byte counts and byte rates are integers. Where an exact result is fractional, a *demand*
  (``pool_bytes``, ``read_bytes_per_s``, ``write_bytes_per_s``, ``inflight_bytes``,
  ``lookups_per_s``) is rounded up and a *supply* (``nic_usable_bytes_per_s``) is rounded
  down, so the budget errs on the safe side. With integer ``rps`` the rates are exact.
* ``nic_headroom`` is a ratio and the only float: usable NIC bandwidth over read bandwidth,
  from the exact values (``None`` when nothing is read).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

from persisting.errors import ConfigError

Number = int | float | str | Decimal | Fraction

#: Bytes per element of the KV cache dtypes engines use (aliases map to the same size).
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

Unit = Literal["bytes", "bytes/s", "count", "count/s", "ratio"]


@dataclass(frozen=True)
class PlanLine:
    """One line of a plan: its JSON name, what kind of figure it is, and what it means."""

    name: str
    unit: Unit
    meaning: str


#: Every output of a plan, in reading order, with the one phrase that explains it.
PLAN_LINES: tuple[PlanLine, ...] = (
    PlanLine("bytes_per_token", "bytes", "2 (K, V) x layers x KV heads x head dim x dtype"),
    PlanLine("bytes_per_prefix", "bytes", "prefix tokens x bytes per token"),
    PlanLine("total_bytes", "bytes", "prefixes x bytes per prefix, one copy"),
    PlanLine("replicated_bytes", "bytes", "total bytes x replicas"),
    PlanLine("pool_bytes", "bytes", "replicated bytes / fill; the rest: staging, metadata"),
    PlanLine("chunks_per_prefix", "count", "prefix tokens / chunk size, rounded up"),
    PlanLine("logical_chunks", "count", "prefixes x chunks per prefix"),
    PlanLine("objects", "count", "logical chunks x TP: one object per rank per chunk"),
    PlanLine("replica_records", "count", "objects x replicas: entries the directory tracks"),
    PlanLine("bytes_per_object", "bytes", "chunk size x bytes per token / TP: one rank's share"),
    PlanLine("read_bytes_per_s", "bytes/s", "rps x bytes per prefix: each reads its prefix"),
    PlanLine("write_bytes_per_s", "bytes/s", "rps x new fraction x new-prefix bytes x replicas"),
    PlanLine("lookups_per_s", "count/s", "rps x chunks per prefix x TP: objects looked up"),
    PlanLine("inflight_bytes", "bytes", "read rate x staging time: bytes held in staging"),
    PlanLine("nic_usable_bytes_per_s", "bytes/s", "NIC Gbps x 1e9 / 8 x efficiency"),
    PlanLine("nic_headroom", "ratio", "usable NIC / read rate: above 1 the reads fit"),
)


@dataclass(frozen=True)
class PlanInputs:
    """The workload and hardware a plan is made for (fractions hold the typed decimals)."""

    bytes_per_token: int
    prefix_tokens: int
    prefixes: int
    chunk_size: int
    tp: int
    replicas: int
    fill: Fraction
    rps: Fraction
    new_prefix_fraction: Fraction
    new_prefix_tokens: int
    staging_ms: Fraction
    nic_gbps: Fraction
    nic_efficiency: Fraction
    #: ``layers``/``kv_heads``/``head_dim``/``dtype`` when the model was given by shape,
    #: ``None`` when ``bytes_per_token`` was given directly.
    model_shape: dict[str, int | str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly inputs: whole fractions become ints, the others floats."""
        return {k: _plain(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class CapacityPlan:
    """The budget: every field named in :data:`PLAN_LINES`, plus the inputs it came from."""

    inputs: PlanInputs
    bytes_per_token: int
    bytes_per_prefix: int
    total_bytes: int
    replicated_bytes: int
    pool_bytes: int
    chunks_per_prefix: int
    logical_chunks: int
    objects: int
    replica_records: int
    bytes_per_object: int
    read_bytes_per_s: int
    write_bytes_per_s: int
    lookups_per_s: int
    inflight_bytes: int
    nic_usable_bytes_per_s: int
    nic_headroom: float | None

    def to_dict(self) -> dict[str, Any]:
        """The outputs under their documented names, and the inputs under ``"inputs"``."""
        out: dict[str, Any] = {line.name: getattr(self, line.name) for line in PLAN_LINES}
        out["inputs"] = self.inputs.to_dict()
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else float(value)
    return value


def exact(value: Number, name: str) -> Fraction:
    """``value`` as an exact fraction, reading floats as the decimal they print as."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, not {value!r}")
    if isinstance(value, float | Decimal) and not _is_finite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    try:
        # repr(0.7) == "0.7": a float is read as the shortest decimal that prints it.
        return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        raise ConfigError(f"{name} must be a number, got {value!r}") from exc


def _is_finite(value: float | Decimal) -> bool:
    return value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of K and V one token occupies across all layers: 2 x L x H x D x dtype size."""
    _positive_int(layers, "layers")
    _positive_int(kv_heads, "kv_heads")
    _positive_int(head_dim, "head_dim")
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    """Element size of a KV dtype name such as ``bf16`` or ``float8_e4m3fn``."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ConfigError(f"unknown dtype {dtype!r}; known: {known}")
    return DTYPE_BYTES[key]


def plan_capacity(
    *,
    prefix_tokens: int,
    prefixes: int,
    bytes_per_token: int | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
    chunk_size: int = 256,
    tp: int = 1,
    replicas: int = 1,
    fill: Number = "0.7",
    rps: Number = 0,
    new_prefix_fraction: Number = 0,
    new_prefix_tokens: int | None = None,
    staging_ms: Number = 100,
    nic_gbps: Number = 200,
    nic_efficiency: Number = "0.7",
) -> CapacityPlan:
    """The capacity and bandwidth budget of a shared KV tier.

    Give the model either as ``layers``/``kv_heads``/``head_dim``/``dtype`` or as
    ``bytes_per_token`` (MLA and other layouts; MLA's latent is not split across TP ranks,
    so plan it with ``tp=1``). ``new_prefix_tokens`` defaults to ``prefix_tokens``.
    Impossible or contradictory inputs raise :class:`~persisting.errors.ConfigError`.
    """
    inputs = _validated_inputs(
        bytes_per_token=bytes_per_token,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        prefix_tokens=prefix_tokens,
        prefixes=prefixes,
        chunk_size=chunk_size,
        tp=tp,
        replicas=replicas,
        fill=fill,
        rps=rps,
        new_prefix_fraction=new_prefix_fraction,
        new_prefix_tokens=new_prefix_tokens,
        staging_ms=staging_ms,
        nic_gbps=nic_gbps,
        nic_efficiency=nic_efficiency,
    )
    return _budget(inputs)


def _budget(i: PlanInputs) -> CapacityPlan:
    bytes_per_prefix = i.prefix_tokens * i.bytes_per_token
    total_bytes = i.prefixes * bytes_per_prefix
    replicated_bytes = total_bytes * i.replicas
    chunks_per_prefix = -(-i.prefix_tokens // i.chunk_size)
    logical_chunks = i.prefixes * chunks_per_prefix
    objects = logical_chunks * i.tp
    read_rate = i.rps * bytes_per_prefix
    write_rate = (
        i.rps * i.new_prefix_fraction * i.new_prefix_tokens * i.bytes_per_token * i.replicas
    )
    nic_usable = i.nic_gbps * 10**9 / 8 * i.nic_efficiency
    return CapacityPlan(
        inputs=i,
        bytes_per_token=i.bytes_per_token,
        bytes_per_prefix=bytes_per_prefix,
        total_bytes=total_bytes,
        replicated_bytes=replicated_bytes,
        pool_bytes=math.ceil(replicated_bytes / i.fill),
        chunks_per_prefix=chunks_per_prefix,
        logical_chunks=logical_chunks,
        objects=objects,
        replica_records=objects * i.replicas,
        bytes_per_object=i.chunk_size * i.bytes_per_token // i.tp,
        read_bytes_per_s=math.ceil(read_rate),
        write_bytes_per_s=math.ceil(write_rate),
        lookups_per_s=math.ceil(i.rps * chunks_per_prefix * i.tp),
        inflight_bytes=math.ceil(read_rate * i.staging_ms / 1000),
        nic_usable_bytes_per_s=math.floor(nic_usable),
        nic_headroom=float(nic_usable / read_rate) if read_rate else None,
    )


def _validated_inputs(
    *,
    bytes_per_token: int | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype: str | None,
    prefix_tokens: int,
    prefixes: int,
    chunk_size: int,
    tp: int,
    replicas: int,
    fill: Number,
    rps: Number,
    new_prefix_fraction: Number,
    new_prefix_tokens: int | None,
    staging_ms: Number,
    nic_gbps: Number,
    nic_efficiency: Number,
) -> PlanInputs:
    shape: dict[str, Any] = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    model_shape: dict[str, int | str] | None = None
    _positive_int(tp, "tp")
    if bytes_per_token is not None:
        given = [name for name, v in {**shape, "dtype": dtype}.items() if v is not None]
        if given:
            raise ConfigError(
                f"give either bytes_per_token or the model shape, not both (also got {given})"
            )
        _positive_int(bytes_per_token, "bytes_per_token")
    else:
        missing = [name for name, v in shape.items() if v is None]
        if missing:
            raise ConfigError(
                f"the model shape needs layers, kv_heads and head_dim (missing {missing}), "
                "or give bytes_per_token directly"
            )
        model_shape = {**shape, "dtype": dtype or "bf16"}
        bytes_per_token = kv_bytes_per_token(layers, kv_heads, head_dim, dtype or "bf16")  # type: ignore[arg-type]
        if kv_heads % tp:  # type: ignore[operator]
            raise ConfigError(
                f"tp={tp} does not split kv_heads={kv_heads} evenly; heads replicated across "
                "ranks are not modelled (plan with bytes_per_token and a tp that divides it)"
            )
    for name, value in (
        ("prefix_tokens", prefix_tokens),
        ("prefixes", prefixes),
        ("chunk_size", chunk_size),
        ("replicas", replicas),
    ):
        _positive_int(value, name)
    if new_prefix_tokens is None:
        new_prefix_tokens = prefix_tokens
    _non_negative_int(new_prefix_tokens, "new_prefix_tokens")
    if (chunk_size * bytes_per_token) % tp:
        raise ConfigError(
            f"a chunk of {chunk_size * bytes_per_token} bytes does not split evenly over tp={tp}"
        )
    return PlanInputs(
        bytes_per_token=bytes_per_token,
        prefix_tokens=prefix_tokens,
        prefixes=prefixes,
        chunk_size=chunk_size,
        tp=tp,
        replicas=replicas,
        fill=_in_range(fill, "fill", low_open=True),
        rps=_at_least_zero(rps, "rps"),
        new_prefix_fraction=_in_range(new_prefix_fraction, "new_prefix_fraction", low_open=False),
        new_prefix_tokens=new_prefix_tokens,
        staging_ms=_at_least_zero(staging_ms, "staging_ms"),
        nic_gbps=_above_zero(nic_gbps, "nic_gbps"),
        nic_efficiency=_in_range(nic_efficiency, "nic_efficiency", low_open=True),
        model_shape=model_shape,
    )


def _positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")


def _non_negative_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}")


def _at_least_zero(value: Number, name: str) -> Fraction:
    number = exact(value, name)
    if number < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return number


def _above_zero(value: Number, name: str) -> Fraction:
    number = exact(value, name)
    if number <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return number


def _in_range(value: Number, name: str, *, low_open: bool) -> Fraction:
    """A fraction in (0, 1] when ``low_open``, else in [0, 1]."""
    number = exact(value, name)
    too_low = number <= 0 if low_open else number < 0
    if too_low or number > 1:
        bounds = "(0, 1]" if low_open else "[0, 1]"
        raise ConfigError(f"{name} must be in {bounds}, got {value!r}")
    return number


__all__ = [
    "DTYPE_BYTES",
    "PLAN_LINES",
    "CapacityPlan",
    "PlanInputs",
    "PlanLine",
    "dtype_bytes",
    "exact",
    "kv_bytes_per_token",
    "plan_capacity",
]
