"""Settings shared by the CLI, the actor service and the LMCache plugin.

One :class:`PersistingSettings` object is read from (highest priority first) keyword
arguments, ``PERSISTING_*`` environment variables (nested sections with ``__``, e.g.
``PERSISTING_KV__MEMORY_BYTES``), a TOML file named by ``PERSISTING_CONFIG`` or passed to
:meth:`PersistingSettings.from_toml`, and the defaults below.

Mistakes are refused, not ignored: a key no section has (``memory_byte``, a ``[servce]``
section, ``PERSISTING_KV__MEMORY_BYTE``) is a :class:`~persisting.errors.ConfigError`
naming the key, where it came from and the closest valid one. Sizes take units anywhere
(``8GiB``, ``512MB``, ``16MiB``, or plain bytes): ``GiB``/``MiB`` are powers of 2,
``GB``/``MB`` powers of 10. :mod:`persisting.cli.config_sample` writes every setting with its
default.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from persisting.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pydantic-settings reads TOML with tomli there too
    import tomli as tomllib

GiB = 1 << 30
MiB = 1 << 20


def parse_bytes(value: Any) -> Any:
    """A size with a unit (``"8GiB"``, ``"512MB"``, ``"16 MiB"``) as a plain ``int`` of
    bytes (pydantic's ByteSize does the parsing); ints and other values pass through."""
    if isinstance(value, str):
        return int(_BYTE_SIZE.validate_python(value))
    return value


_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)


def size_bytes(value: Any, name: str = "size", *, positive: bool = False) -> int:
    """Bytes from ``value``, as every Persisting size reads: an int, or a string with an
    optional unit (``512MB`` is 512*10^6, ``64GiB`` 64*2^30, ``1.5GiB``, ``16 MiB``,
    ``4096``). ``name`` is the key the user wrote, for the message; ``positive``: 0 is
    refused too. Anything else is a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{name} must be a size in bytes or with a unit, got {value!r}")
    if isinstance(value, int | float) and value < 0:
        raise ConfigError(f"{name} must not be negative, got {value!r}")
    try:
        size = int(_BYTE_SIZE.validate_python(value))
    except ValidationError:
        raise ConfigError(
            f"{name} must be a size in bytes or with a unit (4096, 512MB, 64GiB), got {value!r}"
        ) from None
    if positive and size <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return size


#: A size in bytes: an integer, or a string with a unit. Validated values are plain ints
#: (never a ByteSize), so they travel in messages any peer can decode.
Bytes = Annotated[int, BeforeValidator(parse_bytes)]

KVDurability = Literal["sync", "async", "write_back"]
#: The eviction policies (``persisting.kv.eviction.policy``), and the one every deployment kind uses
#: unless told otherwise: it keeps what will be reused (docs/operating.md#eviction).
Eviction = Literal["lru", "prefix", "value"]
DEFAULT_EVICTION: Eviction = "value"
QueueDurability = Literal["wal", "flush"]
#: Who may read the files under the storage root: ``owner`` (directories 0700, files 0600)
#: or ``group`` (0750/0640: the owner's group may read payloads, e.g. same-host readers
#: running as another user of that group). Lock and counter files stay 0600 either way.
StorageAccess = Literal["owner", "group"]

ENV_PREFIX = "PERSISTING_"
#: ``PERSISTING_*`` variables that are not settings (never refused as unknown).
OTHER_VARIABLES = frozenset({"PERSISTING_CONFIG", "PERSISTING_SKIP_LMCACHE"})

_SECTION = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def socket_address(text: str, what: str = "address") -> tuple[str, int]:
    """``"IP:PORT"`` (``"[IPv6]:PORT"``) as ``(ip, port)``; anything else is a ConfigError
    naming ``what``. Pulsing binds and advertises literal addresses, so a host name such as
    ``localhost`` is refused with the address to use instead."""
    host, sep, port_text = str(text).strip().rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what} must be IP:PORT (e.g. 127.0.0.1:8610), got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    problems = []
    try:
        ip = str(ipaddress.ip_address(host))
    except ValueError:
        ip = host
        if host == "localhost":
            problems.append("a host name is not resolved: use 127.0.0.1")
        elif host.replace(".", "").isdigit() or ":" in host:
            problems.append(f"{host} is not an IP address")
        else:
            problems.append(f"{host} is a host name, not an IP address")
    if not port_text.isdigit() or int(port_text) > 65535:
        problems.append(f"the port must be 0 to 65535, not {port_text!r}")
    if problems:
        raise ConfigError(f"{what} {text}: {'; '.join(problems)}")
    return ip, int(port_text)


class KVSettings(BaseModel):
    """The KV-cache store: tier budgets, completion mode and policies."""

    model_config = _SECTION

    memory_bytes: Bytes = Field(default=2 * GiB, ge=0)
    """Memory tier budget per model (0: no memory tier)."""
    disk_bytes: Bytes = Field(default=64 * GiB, ge=0)
    """Disk budget of the storage root (0: no disk tier), shared by its namespaces: room is
    taken chunk by chunk from those idle over 10 minutes first, then from the one most over
    its fair share (this divided by the namespaces live or idle under 10 minutes)."""
    durability: KVDurability = "sync"
    """When a put returns: "sync" (fsynced on disk), "async" (in memory, disk write
    behind), "write_back" (in memory, written when evicted or on close)."""
    write_behind_lag_s: float = Field(default=2.0, gt=0)
    """async/write_back: the longest a value waits for the write-behind at low priority
    before the writes go on at normal priority (its durability lag while cores are busy)."""
    write_behind_bytes: Bytes = Field(default=2 * GiB, gt=0)
    """async/write_back: acknowledged bytes not yet on disk beyond which the writes go on
    at normal priority and puts wait for them (at most this much is lost in a crash)."""
    chunk_size: int = Field(default=256, gt=0)
    """Tokens per chunk when hashing token ids into keys."""
    hash_scheme: Literal["persisting", "lmcache"] = "persisting"
    """How token ids hash into chunk keys for ``lookup_tokens`` and token events:
    "persisting" (its own chain, seeded by the model), or "lmcache" (the keys LMCache's
    ``ChunkedTokenDatabase`` gives, for chunks LMCache stored through a Persisting plugin)."""
    key_dtype: str = "bfloat16"
    """The KV dtype token lookups (``lookup_tokens``, ``plan_tokens``, token events) hash
    keys with unless told otherwise: your model's (``bfloat16``, ``float16``/``half``,
    ``float32``/``float``...). Keys name their dtype, so a lookup with another finds
    nothing."""
    max_value_bytes: Bytes = Field(default=1 * GiB, gt=0)
    """Largest value a put accepts."""
    model_version: str | None = None
    """The version of the weights the served models' KV comes from (persisting serve, the
    LMCache plugin). KV of other weights is wrong KV, so each version gets a namespace of
    its own: left unset, the weights are fingerprinted from the model's files when they are
    on this host (a local directory or the Hugging Face cache), else only the name is
    known and a warning asks for this setting. Change it whenever the weights change."""
    eviction: Eviction = DEFAULT_EVICTION
    """Eviction order: "value" (keeps what will be reused: frequency, recency, place in its
    chain, miss cost per byte; docs/operating.md#eviction), "lru", or "prefix" (suffix
    chunks go before the prefixes they need, oldest first)."""
    admission: Literal["always", "second_sighting"] = "always"
    """Which puts are stored: "always", or "second_sighting" (a key's second put)."""
    result_buffer_bytes: Bytes = Field(default=256 * MiB, ge=0)
    """Pages reused for the values get returns in-process (0: a fresh array each time)."""
    pinned_memory: Literal["auto", "on", "off"] = "auto"
    """Page-lock (pin) host buffers for DMA to and from GPUs: "auto" when CUDA is present,
    "on" (an error without CUDA) or "off". Pinned pages are committed up front."""
    pinned_staging_bytes: Bytes = Field(default=256 * MiB, ge=0)
    """The pinned staging region through which disk hits go up to a device and device values
    come down for puts (one region, carved per chunk; 0: no staging region)."""
    read_threads: int = Field(default=8, ge=1, le=256)
    """Disk reads a batched get keeps in flight (positioned reads release the GIL; 1 reads
    one chunk after another)."""


class QueueSettings(BaseModel):
    """The Lance queue backend: batching, durability and background maintenance."""

    model_config = _SECTION

    batch_size: int = Field(default=100, gt=0)
    """Flush when this many records are buffered."""
    durability: QueueDurability = "wal"
    """"wal" (a put is durable in the write-ahead log when it returns) or "flush"."""
    fsync_interval_ms: float = Field(default=0.0, ge=0)
    """0: fsync the log before each acknowledgement; N: every N ms."""
    flush_interval_s: float = Field(default=1.0, ge=0)
    """Flush this long after the oldest buffered put (0: only by size)."""
    compact_max_fragments: int = Field(default=32, gt=1)
    """Small fragments tolerated before a compaction."""
    retention_s: float | None = Field(default=None, gt=0)
    """Trim records older than this many seconds (unset: keep them)."""
    retain_until_consumed: bool = False
    """Trim what every committed consumer has read."""
    version_retention_s: float = Field(default=10.0, ge=0)
    """Lance versions younger than this are kept for readers still on them."""


class ServiceSettings(BaseModel):
    """The Pulsing actor service and its client."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

    name: str = "kvstore"
    """Actor name; every storage node of one service uses the same name."""
    addr: str = "127.0.0.1:8610"
    """IP:port the server listens on."""
    seeds: list[str] = Field(default_factory=list)
    """Cluster members to join (servers) or to find the servers through (clients): list
    several (every server, ideally), so the cluster is found through any live one."""
    passphrase: str | None = None
    """Cluster passphrase (TLS). Unset: a server generates one, kept in ``passphrase_file``,
    and serves loopback only (see persisting.service.passphrase)."""
    passphrase_file: Path | None = None
    """Where a generated passphrase is kept (default: $XDG_STATE_HOME/persisting/passphrase)."""
    max_inflight: int = Field(default=16, gt=0, le=16)
    """Requests in flight per server per client (Pulsing's connection pool is 16)."""
    lease_ttl_s: float = Field(default=30.0, gt=0)
    """A session's pins and read leases expire this long after its last renewal."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve Prometheus metrics on this port (0: any free port; unset: none)."""
    event_topic: str = "kv-events"
    """Queue topic of prewarm/evict events."""
    request_timeout_s: float = Field(default=30.0, gt=0)
    """A request unanswered this long counts as a failure of its server; on a data
    connection, the longest a value (of a get's reply or a put) may take to move, from its
    first byte to its last, before the server closes the connection."""
    shared_memory_tier: bool = True
    """Keep the memory tier in shared memory, so same-host clients copy hits out themselves."""
    prefault_memory: bool = True
    """Map each served store's memory tier in at start, in the background (resident memory
    grows to ``kv.memory_bytes`` then), so the first values put after a start do not fault
    every page they land in (false: pages are committed and mapped as values arrive)."""
    bulk_port: int = Field(default=0, ge=0, le=65535)
    """Port of the data path (where every value moves), on the host of ``addr`` and nowhere
    else (0: any free port, told to clients in ``hello``). Clients on the server's host use
    its Unix socket instead."""
    bulk_streams: int = Field(default=4, ge=1, le=16)
    """Data connections a client opens per server; a batch is spread over them."""
    bulk_encryption: bool = True
    """Encrypt data connections off loopback (TLS 1.3; the server's certificate is made at
    start and pinned by clients through ``hello``). Loopback and the Unix socket stay
    plain. False: values (and the sessions' credentials) cross the network in clear; only
    on a network nobody else can read."""
    bulk_connections: int = Field(default=256, gt=0)
    """Data connections one server holds at most (every client's together)."""
    network_bytes_per_s: Bytes | None = Field(default=None, gt=0)
    """What a client assumes it reads from a server on another host (bytes/s) until it has
    measured it (a load-or-recompute plan prices remote hits with it; unset: a path never
    read yet counts as free, and the first reads measure it)."""
    staging_bytes: Bytes = Field(default=1 * GiB, gt=0)
    """Bytes of puts a server receives at once (every client's together)."""
    session_staging_bytes: Bytes = Field(default=256 * MiB, gt=0)
    """Of those, what one session may have in flight at once."""
    member_retry_s: float = Field(default=2.0, gt=0)
    """How often a client probes a server that failed."""
    discovery_timeout_s: float = Field(default=10.0, gt=0)
    """How long connect waits for servers to appear."""
    settle_s: float = Field(default=5.0, ge=0)
    """How long connect waits, at most, for servers the live ones report but this client
    has not found yet (so its first placements see the whole cluster)."""
    replicas: int = Field(default=2, ge=1, le=8)
    """How many members keep a copy of a key: the first ``replicas`` live members of its
    rendezvous ranking (fewer while fewer members live). A put counts as stored once the
    first of them stored it; the copies follow in the background (``copy_on``)."""
    copy_on: Literal["read", "put"] = "read"
    """When a key's further copies are made: once it is first read back (``read``: a
    chunk used only once never costs a second copy's room) or as soon as it is stored
    (``put``)."""
    copy_bytes_per_s: Bytes = Field(default=256 * MiB, gt=0)
    """The rate at which a member sends copies to the others (new copies, and the keys a
    member that joined or came back should hold)."""
    event_batch_records: int = Field(default=64, gt=0)
    """Events applied (and committed) per step."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """The server's log level."""
    log_format: Literal["text", "json"] = "text"
    """The server's log format: text lines, or one JSON object per line."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("addr")
    @classmethod
    def _ip_and_port(cls, value: str) -> str:
        socket_address(value, "service.addr")
        return value

    @field_validator("seeds")
    @classmethod
    def _seed_addresses(cls, value: list[str]) -> list[str]:
        for seed in value:
            socket_address(seed, "a service.seeds entry")
        return value


class PersistingSettings(BaseSettings):
    """Everything a Persisting process needs to know, from env, TOML or arguments."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
    )

    storage_path: Path = Path("./persisting-data")
    """The storage root: KV chunks under kv/, queues under queue/."""
    storage_access: StorageAccess = "owner"
    """Who may read files under the root: "owner" (dirs 0700, files 0600) or "group"
    (0750/0640). Lock and counter files stay 0600 either way."""
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Models persisting serve serves (PERSISTING_MODELS=a/b,c/d)."""
    kv: KVSettings = Field(default_factory=KVSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    service: ServiceSettings = Field(default_factory=ServiceSettings)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(describe_errors(exc, values)) from exc

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value: Any) -> Any:
        # PERSISTING_MODELS=a/b,c/d is the natural shell form; JSON lists work too.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        check_environment(os.environ)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = settings_file()
        if toml_file:
            if not Path(toml_file).is_file():
                named = "" if _TOML_FILE.get() else " (named by PERSISTING_CONFIG)"
                raise ConfigError(f"settings file not found: {toml_file}{named}")
            sources.append(_CheckedTomlSource(settings_cls, toml_file=Path(toml_file)))
        return tuple(sources)

    @classmethod
    def load(cls, toml_file: str | Path | None = None, **overrides: Any) -> PersistingSettings:
        """Settings from a TOML file (if given; else ``PERSISTING_CONFIG``), the environment
        and ``overrides``. Invalid settings raise :class:`~persisting.errors.ConfigError`."""
        if toml_file is not None and not Path(toml_file).is_file():
            raise ConfigError(f"settings file not found: {toml_file}")
        token = _TOML_FILE.set(str(toml_file) if toml_file is not None else None)
        try:
            return cls(**overrides)
        finally:
            _TOML_FILE.reset(token)

    from_toml = load


#: The TOML file of the :meth:`PersistingSettings.load` call in progress (below env).
_TOML_FILE: ContextVar[str | None] = ContextVar("persisting_toml_file", default=None)


def settings_file() -> str | None:
    """The TOML file settings are read from now: ``load``'s, else ``PERSISTING_CONFIG``."""
    return _TOML_FILE.get() or os.environ.get("PERSISTING_CONFIG") or None


# ---------------------------------------------------------------------------------------
# Refusing unknown keys, with the closest valid one
# ---------------------------------------------------------------------------------------


def setting_fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """``model``'s field names, each with its section model (None for a plain value)."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        kind = info.annotation
        out[name] = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
    return out


def accepted_names(model: type[BaseModel]) -> set[str]:
    """The keys ``model`` takes: its field names and the earlier names still accepted."""
    names = set(model.model_fields)
    for info in model.model_fields.values():
        if isinstance(info.validation_alias, AliasChoices):
            names.update(str(choice) for choice in info.validation_alias.choices)
    return names


def closest(name: str, candidates: list[str] | tuple[str, ...] | set[str]) -> str | None:
    """The candidate most like ``name`` (a typo's intended key), if any is close."""
    found = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def _unknown(dotted: str, known: Mapping[str, Any], where: str, spell: Any = str) -> str:
    name = dotted.rsplit(".", 1)[-1]
    guess = closest(name, set(known))
    prefix = dotted[: -len(name)]
    hint = f"; did you mean {spell(prefix + guess)}?" if guess else ""
    return f"unknown setting {spell(dotted)} in {where}{hint}"


def check_keys(data: Mapping[str, Any], where: str, model: type[BaseModel] | None = None) -> None:
    """ConfigError for the first key of ``data`` (a TOML document) no section has."""
    model = model or PersistingSettings
    fields = setting_fields(model)
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(_unknown(str(key), fields, where))
        section = fields[key]
        if section is not None and isinstance(value, Mapping):
            for sub in value:
                if sub not in accepted_names(section):
                    raise ConfigError(_unknown(f"{key}.{sub}", section.model_fields, where))


def _variable(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "__").upper()


def check_environment(environ: Mapping[str, str]) -> None:
    """ConfigError for a ``PERSISTING_*`` variable that looks like a setting but is none.

    Refused: a nested name (``PERSISTING_<SECTION>__<FIELD>``) whose section or field does
    not exist, and a plain name that is one typo away from a setting
    (``PERSISTING_STORAGE_PAHT``). Other names are left alone (they may be another tool's).
    """
    fields = setting_fields(PersistingSettings)
    for variable in environ:
        upper = variable.upper()
        if not upper.startswith(ENV_PREFIX) or upper in OTHER_VARIABLES:
            continue
        name = upper[len(ENV_PREFIX) :].lower()
        section_name, nested, field = name.partition("__")
        where = "the environment"
        if nested:
            section = fields.get(section_name)
            if section is None:
                guess = closest(section_name, {k for k, v in fields.items() if v is not None})
                hint = f"; did you mean {_variable(f'{guess}.{field}')}?" if guess else ""
                raise ConfigError(f"unknown setting {variable} in {where}{hint}")
            if field not in accepted_names(section):
                raise ConfigError(
                    _unknown(f"{section_name}.{field}", section.model_fields, where, _variable)
                )
        elif name not in fields and closest(name, set(fields)) is not None:
            raise ConfigError(_unknown(name, fields, where, _variable))


class _CheckedTomlSource(TomlConfigSettingsSource):
    """The TOML file, refused whole if it is missing, does not parse or has unknown keys."""

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            with Path(file_path).open("rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError as exc:
            raise ConfigError(f"settings file not found: {file_path}") from exc
        except OSError as exc:
            raise ConfigError(f"cannot read settings file {file_path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file_path} is not valid TOML: {exc}") from exc
        check_keys(data, str(file_path))
        return data


def describe_errors(exc: ValidationError, arguments: Mapping[str, Any]) -> str:
    """One line per invalid setting: its dotted name, what is wrong, and where it came from
    (an argument, a ``PERSISTING_*`` variable or the TOML file)."""
    parts = []
    for error in exc.errors():
        dotted = ".".join(str(p) for p in error["loc"])
        if error["type"] == "extra_forbidden":
            parts.append(_unknown_anywhere(error["loc"]))
            continue
        where = _origin(error["loc"], arguments)
        cause = (error.get("ctx") or {}).get("error")
        if error["type"] == "value_error" and cause is not None:
            parts.append(f"{cause}{f' (from {where})' if where else ''}")
        else:
            got = f"got {error['input']!r}{f' from {where}' if where else ''}"
            parts.append(f"{dotted}: {error['msg']} ({got})")
    return "invalid settings: " + "; ".join(parts)


def _unknown_anywhere(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = PersistingSettings
    for part in loc[:-1]:
        section = setting_fields(model).get(str(part))
        if section is None:
            break
        model = section
    dotted = ".".join(str(p) for p in loc)
    return _unknown(dotted, model.model_fields, "the arguments")


def _origin(loc: tuple[Any, ...], arguments: Mapping[str, Any]) -> str:
    if loc and loc[0] in arguments:
        return ""
    variable = _variable(".".join(str(p) for p in loc))
    if variable in {k.upper() for k in os.environ}:
        return variable
    return settings_file() or ""


def size_text(n: int) -> str:
    """``2147483648`` -> ``2GiB``: the largest binary unit that divides ``n`` exactly."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


__all__ = [
    "OTHER_VARIABLES",
    "Bytes",
    "KVSettings",
    "PersistingSettings",
    "QueueSettings",
    "ServiceSettings",
    "StorageAccess",
    "check_environment",
    "check_keys",
    "closest",
    "describe_errors",
    "parse_bytes",
    "setting_fields",
    "settings_file",
    "size_bytes",
    "size_text",
    "socket_address",
]
