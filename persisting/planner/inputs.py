"""What a plan is made for: one :class:`PlanInputs` value, checked as it is made.

Fractional inputs are read as the decimal typed (``0.7`` is 7/10, not the nearest binary
float) so every figure is an exact fraction until it is rounded. Sizes take units
(``"3.84TB"``, ``"512GiB"``) and rates a ``/s`` (``"7GB/s"``). Every mistake is a
:class:`~persisting.errors.ConfigError` that notes which inputs it is about (``.fields``),
so the command line can name its flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

from persisting.errors import ConfigError
from persisting.planner.models import (
    ModelPreset,
    dtype_bytes,
    find_gpu,
    find_preset,
    kv_bytes_per_token,
)

Number = int | float | str | Decimal | Fraction


def exact(value: Number, name: str) -> Fraction:
    """``value`` as an exact fraction, reading floats as the decimal they print as."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, not {value!r}").about(name)
    if isinstance(value, float | Decimal) and not _is_finite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}").about(name)
    try:
        # repr(0.7) == "0.7": a float is read as the shortest decimal that prints it.
        return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        raise ConfigError(f"{name} must be a number, got {value!r}").about(name) from exc


def _is_finite(value: float | Decimal) -> bool:
    return value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)


def size(value: int | str, name: str) -> int:
    """A byte count from an int or a string with a unit (``"3.84TB"``, ``"512GiB"``)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size, not {value!r}").about(name)
    try:
        return int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError:
        raise ConfigError(
            f"{name} must be a size such as 512GiB, 3.84TB or a number of bytes, got {value!r}"
        ).about(name) from None


def rate(value: Number, name: str) -> Fraction:
    """Bytes per second from a number or a size per second (``"7GB/s"``, ``"6.5GiB"``)."""
    if isinstance(value, str):
        text = value.strip()
        text = text[:-2] if text.lower().endswith("/s") else text
        if text and text[-1].isalpha():
            return Fraction(size(text, name))
        value = text
    return exact(value, name)


@dataclass(frozen=True)
class ModelShape:
    """How one token of the model's KV is stored: what it weighs and how TP splits it."""

    name: str | None
    hf_id: str | None
    attention: Literal["gqa", "mla", "given"]
    layers: int | None
    kv_heads: int | None
    head_dim: int | None
    dtype: str | None
    #: One copy of the model's KV for one token.
    bytes_per_token: int
    #: What the tier stores per token over all ranks (more than one copy when TP exceeds
    #: the KV heads and every rank saves its replicated head).
    stored_bytes_per_token: int
    #: Objects one chunk becomes: one per TP rank that saves its share.
    objects_per_chunk: int
    #: Whether TP splits a token's KV across ranks (GQA heads) or not (an MLA latent).
    split_over_tp: bool


@dataclass(frozen=True)
class PlanInputs:
    """The model, the workload and (optionally) the hardware a plan is made for.

    The model: a ``model`` preset (``dtype`` may override its dtype), or its shape
    (``layers``, ``kv_heads``, ``head_dim``, ``dtype``, ``mla``), or ``bytes_per_token``
    (with ``tp`` > 1, ``mla`` must say whether TP splits it). The field names are the
    command line's flags (``kv_heads`` is ``--kv-heads``).
    """

    prefix_tokens: int
    prefixes: int
    rps: Number = 0
    model: str | None = None
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None
    mla: bool | None = None
    bytes_per_token: int | None = None
    chunk_size: int = 256
    tp: int = 1
    replicas: int = 1
    fill: Number = "0.7"
    new_prefix_fraction: Number = 0
    new_prefix_tokens: int | None = None
    staging_ms: Number = 100
    nic_gbps: Number = 200
    nic_efficiency: Number = "0.7"
    nodes: int = 1
    disk_bytes: int | str | None = None
    memory_bytes: int | str | None = None
    disk_read: Number | None = None
    disk_write: Number | None = None
    network_read: Number | None = None
    gpu: str | None = None
    prefill_tokens_per_s: Number | None = None
    mfu: Number = "0.5"
    #: Resolved from the model inputs (not an input).
    shape: ModelShape = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("prefix_tokens", "prefixes", "chunk_size", "tp", "replicas", "nodes"):
            _positive_int(getattr(self, name), name)
        new_tokens = (
            self.prefix_tokens if self.new_prefix_tokens is None else self.new_prefix_tokens
        )
        _non_negative_int(new_tokens, "new_prefix_tokens")
        numbers: dict[str, Any] = {
            "rps": _at_least_zero(self.rps, "rps"),
            "fill": _in_range(self.fill, "fill", low_open=True),
            "new_prefix_fraction": _in_range(
                self.new_prefix_fraction, "new_prefix_fraction", low_open=False
            ),
            "staging_ms": _at_least_zero(self.staging_ms, "staging_ms"),
            "nic_gbps": _above_zero(self.nic_gbps, "nic_gbps"),
            "nic_efficiency": _in_range(self.nic_efficiency, "nic_efficiency", low_open=True),
            "mfu": _in_range(self.mfu, "mfu", low_open=True),
            "new_prefix_tokens": new_tokens,
        }
        for name in ("disk_bytes", "memory_bytes"):
            value = getattr(self, name)
            numbers[name] = None if value is None else size(value, name)
        for name in ("disk_read", "disk_write", "network_read", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if value is not None:
                numbers[name] = _positive(
                    rate(value, name) if name != "prefill_tokens_per_s" else exact(value, name),
                    name,
                    value,
                )
        if self.gpu is not None:
            find_gpu(self.gpu)
            if self.prefill_tokens_per_s is not None:
                raise ConfigError(
                    "give gpu or prefill_tokens_per_s, not both (a measured rate beats an estimate)"
                ).about("gpu", "prefill_tokens_per_s")
        for name, value in numbers.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "shape", resolve_shape(self))
        if self.gpu is not None and self.preset is None:
            raise ConfigError(
                "gpu estimates the prefill rate of a model preset: give model too, or "
                "give prefill_tokens_per_s measured"
            ).about("gpu", "model", "prefill_tokens_per_s")

    @property
    def preset(self) -> ModelPreset | None:
        return find_preset(self.model) if self.model is not None else None

    @property
    def hardware_given(self) -> bool:
        return any(
            v is not None
            for v in (self.disk_bytes, self.memory_bytes, self.disk_read, self.disk_write)
        )

    @property
    def recompute_given(self) -> bool:
        return self.gpu is not None or self.prefill_tokens_per_s is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly inputs: whole fractions become ints, the others floats."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.init}


def resolve_shape(i: PlanInputs) -> ModelShape:
    """The model's KV per token and how TP lays it out, from a preset, a shape or bytes."""
    shape_given = {
        name: getattr(i, name)
        for name in ("layers", "kv_heads", "head_dim")
        if getattr(i, name) is not None
    }
    if i.model is not None:
        if shape_given or i.bytes_per_token is not None or i.mla is not None:
            names = [*shape_given, *(["bytes_per_token"] if i.bytes_per_token else [])]
            raise ConfigError(
                f"give model or the shape, not both (also got {', '.join(names) or 'mla'})"
            ).about("model", *names)
        preset = find_preset(i.model)
        return _layout(
            i,
            preset.name,
            preset.hf_id,
            preset.layers,
            preset.kv_heads,
            preset.head_dim,
            i.dtype or preset.dtype,
            mla=preset.mla,
        )
    if i.bytes_per_token is not None:
        given = [*shape_given, *(["dtype"] if i.dtype is not None else [])]
        if given:
            raise ConfigError(
                f"give either bytes_per_token or the model shape, not both "
                f"(also got {', '.join(given)})"
            ).about("bytes_per_token", *given)
        _positive_int(i.bytes_per_token, "bytes_per_token")
        if i.tp > 1 and i.mla is None:
            raise ConfigError(
                f"with bytes_per_token and tp={i.tp}, say whether TP splits it: mla (one "
                "latent, saved once) or no_mla (heads split over the ranks)"
            ).about("bytes_per_token", "tp", "mla", "no_mla")
        split = not i.mla
        objects = i.tp if split else 1
        if (i.chunk_size * i.bytes_per_token) % objects:
            raise ConfigError(
                f"a chunk of {i.chunk_size * i.bytes_per_token} bytes does not split evenly "
                f"over tp={i.tp}"
            ).about("tp", "chunk_size", "bytes_per_token")
        return ModelShape(
            None, None, "given", None, None, None, None,
            i.bytes_per_token, i.bytes_per_token, objects, split,
        )  # fmt: skip
    missing = [n for n in ("layers", "kv_heads", "head_dim") if n not in shape_given]
    if i.mla and "kv_heads" in missing:
        missing.remove("kv_heads")
    if missing:
        raise ConfigError(
            f"the model needs a preset (model), its shape (layers, kv_heads, head_dim; "
            f"missing {', '.join(missing)}) or bytes_per_token"
        ).about("model", *missing, "bytes_per_token")
    assert i.layers is not None and i.head_dim is not None  # checked just above
    kv_heads = i.kv_heads if i.kv_heads is not None else 1
    if i.mla is None and (i.head_dim in (512, 576) or (kv_heads == 1 and i.head_dim > 256)):
        latent = kv_bytes_per_token(i.layers, 1, i.head_dim, i.dtype or "bf16", mla=True)
        raise ConfigError(
            f"head_dim={i.head_dim} with kv_heads={kv_heads} looks like an MLA latent, which "
            f"is stored once per token ({latent:,} bytes), not as K and V: pass mla, or "
            "no_mla if these really are K/V heads"
        ).about("head_dim", "kv_heads", "mla", "no_mla")
    if i.mla and kv_heads != 1:
        raise ConfigError(
            f"an MLA latent serves every head: kv_heads must be 1 (or left out), got {kv_heads}"
        ).about("kv_heads", "mla")
    return _layout(
        i, None, None, i.layers, kv_heads, i.head_dim, i.dtype or "bf16", mla=bool(i.mla)
    )


def _layout(
    i: PlanInputs,
    name: str | None,
    hf_id: str | None,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    *,
    mla: bool,
) -> ModelShape:
    dtype_bytes(dtype)
    one_copy = kv_bytes_per_token(layers, kv_heads, head_dim, dtype, mla=mla)
    if mla:  # one latent per token, the same on every rank, saved by the first
        return ModelShape(
            name, hf_id, "mla", layers, 1, head_dim, dtype, one_copy, one_copy, 1, False
        )
    tp = i.tp
    if kv_heads % tp == 0:
        stored = one_copy
    elif tp % kv_heads == 0:  # engines replicate heads: each rank keeps (and saves) one
        stored = one_copy // kv_heads * tp
    else:
        raise ConfigError(
            f"tp={tp} does not split kv_heads={kv_heads} evenly, nor is it a multiple of it"
        ).about("tp", "kv_heads")
    return ModelShape(
        name, hf_id, "gqa", layers, kv_heads, head_dim, dtype, one_copy, stored, tp, True
    )


def _plain(value: Any) -> Any:
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else float(value)
    return value


def _positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}").about(name)


def _non_negative_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}").about(name)


def _at_least_zero(value: Number, name: str) -> Fraction:
    number = exact(value, name)
    if number < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}").about(name)
    return number


def _above_zero(value: Number, name: str) -> Fraction:
    return _positive(exact(value, name), name, value)


def _positive(number: Fraction, name: str, typed: object) -> Fraction:
    if number <= 0:
        raise ConfigError(f"{name} must be > 0, got {typed!r}").about(name)
    return number


def _in_range(value: Number, name: str, *, low_open: bool) -> Fraction:
    """A fraction in (0, 1] when ``low_open``, else in [0, 1]."""
    number = exact(value, name)
    too_low = number <= 0 if low_open else number < 0
    if too_low or number > 1:
        bounds = "(0, 1]" if low_open else "[0, 1]"
        raise ConfigError(f"{name} must be in {bounds}, got {value!r}").about(name)
    return number


__all__ = ["ModelShape", "Number", "PlanInputs", "exact", "rate", "resolve_shape", "size"]
