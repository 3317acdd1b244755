"""``persisting serve | demo | prewarm``: the actor service (``actors/``) and its event topic."""

from __future__ import annotations

import json
import sys
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
from persisting.cli.output import emit, to_jsonable

if TYPE_CHECKING:
    from persisting.config import PersistingSettings

ModelsOption = Annotated[
    list[str] | None,
    typer.Option("--model", "-m", help="A model to serve (repeatable; default: settings)."),
]


def _service_settings(
    config: Path | None,
    storage_path: Path | None,
    models: list[str] | None,
    metrics_port: int | None = None,
    passphrase: str | None = None,
) -> PersistingSettings:
    settings = load_settings(config)
    update: dict[str, Any] = {}
    if storage_path is not None:
        update["storage_path"] = storage_path
    if models:
        update["models"] = list(models)
    service = settings.service.model_copy(
        update={
            k: v
            for k, v in (("metrics_port", metrics_port), ("passphrase", passphrase))
            if v is not None
        }
    )
    return settings.model_copy(update={**update, "service": service})


@command(app, "serve")
def serve(
    storage_path: StoragePathOption = None,
    model: ModelsOption = None,
    addr: Annotated[str | None, typer.Option(help="host:port to listen on.")] = None,
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
    config: ConfigOption = None,
) -> None:
    """Serve the KV store as a Pulsing actor until Ctrl-C (embedded storage root by default)."""
    from actors.launch import serve as serve_forever

    settings = _service_settings(config, storage_path, model, metrics_port, passphrase)
    serve_forever(settings, addr=addr, seeds=seeds or None, name=name, consume_events=not no_events)


@command(app, "demo")
def demo(
    storage_path: StoragePathOption = None,
    model: ModelsOption = None,
    chunks: Annotated[int, typer.Option(min=1, max=64, help="Chunks to store.")] = 4,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """A bounded end-to-end session: serve a store, put, get, look up, evict and prewarm
    through the event topic, show the stats, and exit."""
    import os

    from actors.launch import run_demo

    settings = _service_settings(config, storage_path, model)
    report = run_demo(settings, chunks=chunks)
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


@command(app, "prewarm")
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
    worker_id: Annotated[int, typer.Option(help="Hasher worker id.")] = 0,
    dtype: Annotated[str, typer.Option(help="Key dtype (LMCache's names).")] = "bfloat16",
    storage_path: StoragePathOption = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Publish a prewarm (or --evict) event to the serving actor's event topic."""
    from actors.kv_events import prewarm as publish

    if bool(keys) == (tokens_file is not None):
        fail("give --key (one or more) or --tokens, not both and not neither", EXIT_BAD_INPUT)
    settings = _service_settings(config, storage_path, None)
    tokens = None
    if tokens_file is not None:
        text = tokens_file.read_text().strip()
        try:
            tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.split()]
        except ValueError as exc:
            fail(f"{tokens_file}: not a list of token ids ({exc})", EXIT_BAD_INPUT)
    hasher: dict[str, Any] = {"world_size": world_size, "worker_id": worker_id, "dtype": dtype}
    if chunk_size is not None:
        hasher["chunk_size"] = chunk_size
    published = publish(
        settings,
        model,
        keys=keys or None,
        tokens=tokens,
        op="evict" if evict else "prewarm",
        **hasher,
    )
    result = {
        "model": model,
        "op": "evict" if evict else "prewarm",
        "published": published,
        "topic": settings.service.event_topic,
    }
    emit(
        result,
        json_out,
        lambda console: console.print(
            f"published {published} {result['op']} event(s) for {escape(model)} "
            f"on topic {escape(result['topic'])}"
        ),
    )
