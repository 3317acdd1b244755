"""``persisting serve | demo | prewarm``: the actor service (``actors/``), its topic."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from persisting.cli.app import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    ConfigOption,
    JsonFlag,
    StoragePathOption,
    app,
    command,
    fail,
    load_settings,
)
from persisting.cli.checks import free_port, listen_address, storage_folder, writable_root
from persisting.cli.output import emit, stderr, to_jsonable
from persisting.config import socket_address
from persisting.errors import ConfigError, PersistingError, ServiceUnavailableError

if TYPE_CHECKING:
    from persisting.config import PersistingSettings


class LogLevel(str, Enum):
    """The server log levels ``serve --log-level`` takes."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class HashSchemeChoice(str, Enum):
    """The token hash schemes ``prewarm --hash-scheme`` takes: TokenHasher's two, and
    LMCache's multiprocess server's (keys of chunks its Persisting L2 adapter stored)."""

    persisting = "persisting"
    lmcache = "lmcache"
    lmcache_mp = "lmcache-mp"


ModelsOption = Annotated[
    list[str] | None,
    typer.Option("--model", "-m", help="A model to serve (repeatable; default: settings)."),
]


def service_settings(
    config: Path | None,
    storage_path: Path | None,
    models: list[str] | None = None,
    **service: Any,
) -> PersistingSettings:
    """The settings with the command's flags applied over TOML, environment and defaults
    (``service`` holds the ``[service]`` flags that were given; None means not given)."""
    overrides: dict[str, Any] = {}
    if storage_path is not None:
        overrides["storage_path"] = storage_path
    if models:
        overrides["models"] = list(models)
    given = {k: v for k, v in service.items() if v is not None}
    if given:
        overrides["service"] = given
    return load_settings(config, **overrides)


def check_serving(
    settings: PersistingSettings, given: dict[str, Any], config: Path | None = None
) -> None:
    """Everything ``serve`` can find wrong before it opens a store: the storage root, the
    models, the address and the metrics port, each named by the flag the user typed (or the
    setting it came from). ``given`` holds the flags given on the command line."""
    storage_folder(settings.storage_path, named(given, "storage_path"))
    service = settings.service
    host, _port = listen_address(service.addr, named(given, "addr"))
    for seed in service.seeds:
        socket_address(seed, named(given, "seeds"))
    if service.metrics_port is not None:
        free_port(host, service.metrics_port, named(given, "metrics_port"))


#: The flag of each setting a service command can take.
FLAGS = {
    "storage_path": "--storage-path",
    "addr": "--addr",
    "seeds": "--seed",
    "metrics_port": "--metrics-port",
}


def named(given: dict[str, Any], name: str) -> str:
    """How to name setting ``name`` in a message: its flag if the user typed it, else the
    setting (which came from the TOML file, the environment or the defaults)."""
    if given.get(name) is not None:
        return FLAGS[name]
    return f"setting {'' if name == 'storage_path' else 'service.'}{name}"


@contextmanager
def pulsing_errors(settings: PersistingSettings) -> Iterator[None]:
    """Pulsing's own errors (``__PULSING_ERROR__:{json}``) as one-line Persisting errors."""
    try:
        yield
    except (RuntimeError, ValueError) as exc:
        text = str(exc)
        if _PULSING_MARK not in text and "socket address" not in text:
            raise
        detail = text.partition(_PULSING_MARK)[2]
        try:
            message = str(json.loads(detail).get("message", detail)) if detail else text
        except ValueError:
            message = detail
        if "in use" in message:
            raise ConfigError(
                f"{settings.service.addr}: the port is already in use (another server?)"
            ) from None
        if "socket address" in message:
            raise ConfigError(f"{settings.service.addr}: not an IP:PORT address") from None
        raise ServiceUnavailableError(f"Pulsing: {message}") from None


_PULSING_MARK = "__PULSING_ERROR__:"


@command(app, "serve", rich_help_panel="Service")
def serve(
    storage_path: StoragePathOption = None,
    model: ModelsOption = None,
    addr: Annotated[str | None, typer.Option(help="IP:PORT to listen on.")] = None,
    seeds: Annotated[
        list[str] | None, typer.Option("--seed", help="A cluster member to join (repeatable).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Actor name clients resolve.")] = None,
    passphrase: Annotated[
        str | None,
        typer.Option(
            envvar="PERSISTING_SERVICE__PASSPHRASE",
            help="Cluster passphrase (turns on TLS; clients need the same).",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port (0: any free).")
    ] = None,
    no_events: Annotated[
        bool, typer.Option("--no-events", help="Do not consume the prewarm/evict topic.")
    ] = False,
    log_level: Annotated[
        LogLevel | None, typer.Option(help="Server log level (default: settings, info).")
    ] = None,
    log_json: Annotated[
        bool, typer.Option("--log-json", help="Log one JSON object per line.")
    ] = False,
    config: ConfigOption = None,
) -> None:
    """Serve the KV store as a Pulsing actor until Ctrl-C (embedded storage root by default).

    Without --model it serves whatever namespace an authenticated client opens (a fleet's
    members serve many models); with it, only the namespaces named.

    With no passphrase configured it generates one, which clients of the same user on this
    host find by themselves, and serves loopback only (see docs/service.md).
    """
    from actors.launch import serve as serve_forever

    flags = {
        "addr": addr,
        "seeds": seeds or None,
        "name": name,
        "metrics_port": metrics_port,
        "log_level": log_level.value if log_level is not None else None,
        "log_format": "json" if log_json else None,
    }
    for address in [addr] if addr else []:
        socket_address(address, "--addr")
    for seed in seeds or []:
        socket_address(seed, "--seed")
    settings = service_settings(config, storage_path, model, **flags, passphrase=passphrase)
    check_serving(settings, {**flags, "storage_path": storage_path}, config)
    with pulsing_errors(settings):
        serve_forever(settings, consume_events=not no_events)


@command(app, "demo", rich_help_panel="Service")
def demo(
    storage_path: StoragePathOption = None,
    model: ModelsOption = None,
    chunks: Annotated[int, typer.Option(min=1, max=64, help="Chunks to store.")] = 4,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """A bounded end-to-end session: serve a store, put, get, look up, evict and prewarm
    through the event topic, show the stats, and exit.

    Without --storage-path (or a configured storage_path) it runs on a temporary root,
    removed when it ends."""
    import os
    import shutil
    import tempfile

    from actors.launch import run_demo

    settings = service_settings(config, storage_path, model)
    temporary: str | None = None
    if storage_path is None and "storage_path" not in settings.model_fields_set:
        # No root asked for: a temporary one, removed afterwards (no ./persisting-data left).
        temporary = tempfile.mkdtemp(prefix="persisting-demo-")
        settings = settings.model_copy(update={"storage_path": Path(temporary)})
    try:
        storage_folder(
            settings.storage_path,
            named({"storage_path": storage_path}, "storage_path"),
        )
        with pulsing_errors(settings):
            report = run_demo(settings, chunks=chunks)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    if temporary is not None:
        report["storage_path"] = f"{temporary} (temporary, removed)"
    emit(report, json_out, lambda console: render_demo(console, report))
    sys.stdout.flush()
    os._exit(0 if report.get("bit_exact") else EXIT_FAILED)  # Pulsing may crash at exit


def render_demo(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="persisting demo", show_header=False)
    table.add_column("step", style="bold")
    table.add_column("result")
    for name, value in report.items():
        table.add_row(escape(str(name)), escape(json.dumps(to_jsonable(value))))
    console.print(table)


@command(app, "prewarm", rich_help_panel="Service")
def prewarm(
    model: Annotated[str, typer.Argument(help="Model namespace of the keys.")],
    keys: Annotated[
        list[str] | None, typer.Option("--key", help="A chunk key string (repeatable).")
    ] = None,
    tokens_file: Annotated[
        Path | None,
        typer.Option(
            "--tokens",
            help="A file of token ids (whitespace or JSON list).",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    evict: Annotated[bool, typer.Option(help="Publish an evict event instead.")] = False,
    chunk_size: Annotated[int | None, typer.Option(help="Hasher chunk size (tokens).")] = None,
    world_size: Annotated[int, typer.Option(help="Hasher world size.")] = 1,
    worker_id: Annotated[
        int | None,
        typer.Option(help="Hasher worker id (default 0; with lmcache-mp: every worker)."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Key dtype: the model's KV dtype, torch's or LMCache's name (bfloat16, "
            "float16/half, float32/float...; default: the kv.key_dtype setting)."
        ),
    ] = None,
    hash_scheme: Annotated[
        HashSchemeChoice | None,
        typer.Option(
            help="How --tokens hash into keys: 'persisting'; 'lmcache' for chunks LMCache "
            "stored through the in-process plugin; 'lmcache-mp' for chunks its multiprocess "
            "server stored through the L2 adapter (MODEL is then the adapter's namespace). "
            "Default: the kv.hash_scheme setting.",
            case_sensitive=False,
        ),
    ] = None,
    save_unfull_chunk: Annotated[
        bool,
        typer.Option(
            help="Also name the last partial chunk of --tokens (as LMCache's "
            "save_unfull_chunk does)."
        ),
    ] = False,
    lmcache_model: Annotated[
        str | None,
        typer.Option(help="lmcache-mp: the model name LMCache's server keys chunks with."),
    ] = None,
    cache_salt: Annotated[str, typer.Option(help="lmcache-mp: the requests' cache_salt.")] = "",
    object_group: Annotated[
        list[int] | None,
        typer.Option(help="lmcache-mp: an object group id (repeatable; default 0)."),
    ] = None,
    storage_path: StoragePathOption = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Publish a prewarm (or --evict) event to the serving actor's event topic."""
    from actors.kv_events import prewarm as publish
    from persisting.service.events import MAX_EVENT_KEYS

    if bool(keys) == (tokens_file is not None):
        fail("give --key (one or more) or --tokens, not both and not neither", EXIT_BAD_INPUT)
    settings = service_settings(config, storage_path)
    writable_root(settings.storage_path, "publishing an event appends to its queue")
    tokens = None
    if tokens_file is not None:
        text = tokens_file.read_text().strip()
        try:
            tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.split()]
        except ValueError as exc:
            fail(f"{tokens_file}: not a list of token ids ({exc})", EXIT_BAD_INPUT)
    mp_chunk_size = chunk_size or settings.kv.chunk_size
    if hash_scheme is HashSchemeChoice.lmcache_mp:
        if tokens is None or lmcache_model is None:
            fail("--hash-scheme lmcache-mp needs --tokens and --lmcache-model", EXIT_BAD_INPUT)
        keys = _lmcache_mp_keys(
            model,
            tokens,
            model_name=lmcache_model,
            chunk_size=mp_chunk_size,
            world_size=world_size,
            worker_id=worker_id,
            cache_salt=cache_salt,
            object_group_ids=object_group or [0],
        )
        tokens = None
    hasher: dict[str, Any] = {
        "world_size": world_size,
        "worker_id": worker_id or 0,
        "dtype": dtype or settings.kv.key_dtype,
        "save_unfull_chunk": save_unfull_chunk,
    }
    if chunk_size is not None:
        hasher["chunk_size"] = chunk_size
    if hash_scheme is not None and hash_scheme is not HashSchemeChoice.lmcache_mp:
        hasher["hash_scheme"] = hash_scheme.value
    op = "evict" if evict else "prewarm"
    if keys:  # one event per MAX_EVENT_KEYS keys
        published = sum(
            publish(settings, model, keys=keys[i : i + MAX_EVENT_KEYS], op=op)
            for i in range(0, len(keys), MAX_EVENT_KEYS)
        )
    else:
        published = publish(settings, model, tokens=tokens, op=op, **hasher)
    result: dict[str, Any] = {
        "model": model,
        "op": op,
        "published": published,
        "topic": settings.service.event_topic,
    }
    consumers = live_consumers(settings, model)
    if consumers is not None:
        result["consumers"] = consumers
    if hash_scheme is HashSchemeChoice.lmcache_mp:
        result.update(hash_scheme="lmcache-mp", chunk_size=mp_chunk_size, chunks=len(keys or ()))
    elif tokens is not None:  # how the tokens were hashed, so a miss can be explained
        result["hash_scheme"] = hasher.get("hash_scheme", settings.kv.hash_scheme)
        result["chunk_size"] = hasher.get("chunk_size", settings.kv.chunk_size)
    emit(
        result,
        json_out,
        lambda console: console.print(
            f"published {published} {result['op']} event(s) for {escape(model)} "
            f"on topic {escape(str(result['topic']))}"
        ),
    )


def live_consumers(settings: PersistingSettings, model: str) -> list[str] | None:
    """The live event consumers of the topic under the root that apply ``model``'s events
    (each described), or None where there is none -- then one warning line on stderr: the
    event waits on the topic until a server with a consumer starts on this root. Only a
    ``persisting serve`` consumes events; LMCache and engine processes that open the
    store directly do not."""
    from persisting.lance_store import StorageRoot

    topic = settings.service.event_topic
    root = StorageRoot(settings.storage_path)
    live = [h for h in root.consumer_owners(topic) if h.live]
    serving = [h for h in live if model in (h.details.get("models") or [model])]
    if serving:
        return [h.describe() for h in serving]
    served = sorted({m for h in live for m in h.details.get("models", [])})
    why = f"the live consumer(s) serve {served}, not {model!r}" if live else "none runs"
    stderr().print(
        f"[yellow]Warning:[/] no live consumer applies {escape(model)!r} events on topic "
        f"{escape(topic)!r} under {escape(str(root.root))} ({escape(why)}): the event waits "
        "there until a `persisting serve` of that model starts on this root. LMCache and "
        "engines that open the store directly consume no events (see docs/operating.md).",
        highlight=False,
        soft_wrap=True,
    )
    return None


def _lmcache_mp_keys(namespace: str, tokens: list[int], **settings: Any) -> list[str]:
    """Keys of the chunks LMCache's multiprocess server stores for ``tokens`` (see
    :func:`persisting.integrations.lmcache.object_keys.object_keys_for_tokens`)."""
    from persisting.integrations.lmcache.object_keys import object_keys_for_tokens

    try:
        keys = object_keys_for_tokens(namespace, tokens, **settings)
    except (PersistingError, ValueError) as exc:
        fail(f"cannot hash the tokens as LMCache's server does: {exc}", EXIT_BAD_INPUT)
    if not keys:
        fail(f"no whole chunk of {settings['chunk_size']} tokens in --tokens", EXIT_BAD_INPUT)
    return keys
