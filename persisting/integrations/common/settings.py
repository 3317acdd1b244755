"""The settings every engine adapter shares, read from the engine's own configuration.

Each engine hands Persisting one dict (vLLM's ``kv_connector_extra_config`` or a
``secondary_tiers`` entry, SGLang's storage extra config, LMCache's ``adapter_params``):
its own keys beside ours. :func:`read_settings` checks ours against one pydantic model
(:class:`EngineSettings`, extended by each engine with only its own keys), passes the
engine's through, and refuses anything else with a :class:`~persisting.errors.ConfigError`
naming the key (and the closest known one), so a typo fails the engine's start instead of
a default silently used. Sizes take units, as every Persisting size
(:func:`persisting.config.size_bytes`).

Where the store is: ``storage_path`` (a local root) or ``cluster`` (``{"seeds": [...],
"name": "kvstore", "passphrase_file": PATH}``: the members of a ``persisting serve``
cluster), exactly one of the two. Nothing here imports an engine.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from persisting.config import DEFAULT_EVICTION, Eviction, size_bytes
from persisting.errors import ConfigError


def _size(value: Any) -> int:
    try:
        return size_bytes(value)
    except ConfigError as exc:  # reported under the key's name
        raise ValueError(str(exc).removeprefix("size ")) from None


#: A byte size with an optional unit (``"64GiB"``), never negative.
Size = Annotated[int, BeforeValidator(_size)]


class ClusterSettings(BaseModel):
    """Where a cluster of ``persisting serve`` members is, and how to join it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: ``HOST:PORT`` of members (one that answers is enough: it tells the others).
    seeds: list[str] = Field(min_length=1)
    #: The service's name (``persisting serve --name``).
    name: str = "kvstore"
    #: A file holding the cluster's passphrase (private to its user); left out, the
    #: passphrase a member on this host generated is used (loopback only).
    passphrase_file: Path | None = None

    @field_validator("seeds")
    @classmethod
    def _addresses(cls, seeds: list[str]) -> list[str]:
        for seed in seeds:
            host, _, port = seed.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a seed is HOST:PORT, not {seed!r}")
        return seeds

    def passphrase(self) -> str | None:
        """The passphrase the file holds (None without a file); a ConfigError for a file
        others can read or that cannot be read."""
        if self.passphrase_file is None:
            return None
        from persisting.service.passphrase import read_passphrase

        path = self.passphrase_file.expanduser()
        secret = read_passphrase(path)
        if not secret:
            raise ConfigError(f"cluster.passphrase_file {path} holds no passphrase")
        return secret


class EngineSettings(BaseModel):
    """The keys every engine adapter takes; an engine's class adds its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: A local Persisting storage root: values under ``<storage_path>/kv/<namespace>/``.
    storage_path: Path | None = None
    #: A cluster of ``persisting serve`` members instead of a local root.
    cluster: ClusterSettings | None = None
    #: Disk budget of the namespace (payload and metadata); beyond it the store evicts.
    disk_bytes: Size = 64 << 30
    #: The weights' version, pinned by the operator: part of the namespace, in place of a
    #: fingerprint of the model's files.
    model_version: str | None = None
    #: A readable prefix of the namespace (default: the model's last path part); a digest
    #: of everything that makes KV incompatible is always appended.
    namespace: str | None = None
    #: Threads moving the values of one batch in parallel.
    io_threads: int = Field(default=4, ge=1)
    #: Whether values are fsynced before a write returns.
    fsync: bool = True
    #: Eviction order: "value", "lru" or "prefix" (docs/operating.md#eviction).
    eviction: Eviction = DEFAULT_EVICTION
    #: Seconds between rescans for values other processes wrote or removed (on a miss,
    #: at most this often; 0: on every miss).
    refresh_interval_s: float = Field(default=2.0, ge=0)

    @field_validator("storage_path", mode="before")
    @classmethod
    def _directory(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, str | Path) or not str(value)):
            raise ValueError("must be a directory path")
        return Path(value).expanduser() if value is not None else None

    @field_validator("model_version", "namespace")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty string")
        return value

    @model_validator(mode="after")
    def _one_place(self) -> EngineSettings:
        if (self.storage_path is None) == (self.cluster is None):
            both = "not both" if self.cluster is not None else "one is needed"
            raise ValueError(f"give storage_path or cluster ({both})")
        return self


S = TypeVar("S", bound=EngineSettings)


def read_settings(
    model: type[S],
    options: Mapping[str, Any] | None,
    *,
    where: str,
    passed: Iterable[str] = (),
    refused: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    noun: str = "key",
    missing: str | None = None,
) -> S:
    """``model`` from the Persisting keys of ``options``: ``passed`` (the engine's own
    keys) are skipped; an unknown key, or one of ``refused`` (key: why it does not apply
    here), is a ConfigError naming it (``noun``: what the engine calls its keys); a bad
    value is a ConfigError naming its key; neither ``storage_path`` nor ``cluster`` is one
    saying so (``missing``: the engine's own words for it)."""
    passed = frozenset(passed)
    refused = refused or {}
    known = tuple(name for name in model.model_fields if name not in refused)
    values: dict[str, Any] = dict(defaults or {})
    for key, value in (options or {}).items():
        if key in passed:
            continue
        if key in refused:
            raise ConfigError(
                f"{where}: {noun} {key!r} does not apply here ({refused[key]}); "
                f"Persisting's keys: {', '.join(known)}"
            )
        if key not in known:
            close = difflib.get_close_matches(str(key), [*known, *passed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{where}: unknown {noun} {key!r}{hint}; Persisting's keys: {', '.join(known)}"
            )
        values[key] = value
    if "storage_path" not in values and "cluster" not in values:
        raise ConfigError(
            missing
            or f"{where} needs storage_path (the Persisting storage root to keep KV under) "
            "or cluster (the members of a persisting serve cluster)"
        )
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown key {where!r}"
    message = str(error["msg"]).removeprefix("Value error, ")
    if not where:
        return message
    context = error.get("ctx") or {}
    if error["type"] == "literal_error":
        choices = str(context.get("expected", "")).replace("'", "")
        return f"{where} must be one of {choices}, not {error['input']!r}"
    if error["type"] in ("greater_than_equal", "greater_than"):
        bound = context.get("ge", context.get("gt"))
        sign = ">=" if "ge" in context else ">"
        return f"{where} must be a number {sign} {bound}, got {error['input']!r}"
    got = "" if ", got " in message else f", got {error['input']!r}"
    return f"{where}{'' if message.startswith('must') else ':'} {message}{got}"


__all__ = [
    "ClusterSettings",
    "EngineSettings",
    "Size",
    "read_settings",
]
