"""``persisting inspect | drop | compact | stats``: operating a storage root and a server."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from persisting.cli.app import (
    EXIT_BAD_INPUT,
    ConfigOption,
    JsonFlag,
    StoragePathOption,
    app,
    command,
    fail,
    load_settings,
)
from persisting.cli.checks import writable_root
from persisting.cli.output import count, emit, human_bytes, human_ms, progress_bar

if TYPE_CHECKING:
    from persisting.admin import CompactionResult, RootInfo, StatsReport
    from persisting.figures import ConsumerLag
    from persisting.lance_store import StorageRoot
    from persisting.service.client.survey import ClusterView


def open_storage_root(
    storage_path: Path | None, config: Path | None, writes: str | None = None
) -> StorageRoot:
    """The root named by ``--storage-path``, else by the settings; it must exist, and be
    writable by this user when the command ``writes`` (the reason, for the message)."""
    from persisting.admin import open_root

    path = storage_path or load_settings(config).storage_path
    flag = "--storage-path" if storage_path is not None else "setting storage_path"
    if writes is not None:
        writable_root(path, writes, flag)
    return open_root(path)


@command(app, "inspect", rich_help_panel="Storage root")
def inspect(
    storage_path: StoragePathOption = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """List a storage root: models (chunks, bytes, metadata versions) and queue topics."""
    from persisting.admin import inspect_items, inspect_root

    store = open_storage_root(storage_path, config)
    models, buckets = inspect_items(store)
    with progress_bar("inspecting", len(models) + len(buckets)) as advance:
        info = inspect_root(store, on_item=advance)
    emit(info, json_out, lambda console: render_inspect(console, info))


def describe_namespace(describe: dict[str, Any]) -> str:
    """A namespace's record in one line: ``model ..., dtype ..., block size ...``."""
    if not describe:
        return "-"
    return ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in describe.items())


def render_inspect(console: Console, info: RootInfo) -> None:
    console.print(
        f"Storage root {escape(str(info.root))}: {human_bytes(info.bytes)} on disk, "
        f"{len(info.models)} model(s), {len(info.topics)} queue topic(s).",
        highlight=False,
    )
    notes: list[str] = []
    if info.models:
        models = Table(title="KV models", title_justify="left")
        models.add_column("model", overflow="fold")
        models.add_column("holds", overflow="fold")
        for column in ("chunks", "on disk (du)", "capacity", "meta rows", "versions"):
            models.add_column(column, justify="right")
        for m in info.models:
            models.add_row(
                escape(m.model),
                escape(describe_namespace(m.describe)),
                f"{m.chunks:,}",
                human_bytes(m.bytes),
                human_bytes(m.capacity) if m.capacity is not None else "-",
                count(m.meta_rows),
                count(m.meta_versions),
            )
            if m.note:
                notes.append(f"{m.model}: {m.note}")
            if m.quarantined_files:
                notes.append(
                    f"{m.model}: {m.quarantined_files:,} file(s) "
                    f"({human_bytes(m.quarantined_bytes)}) in quarantine, never served and"
                    f" outside the budget: see `persisting quarantine {m.model}`"
                )
        console.print(models)
        console.print(
            "[dim]on disk: what the namespace's files occupy (as du counts); `persisting "
            "stats` shows the bytes its capacity counts.[/]"
        )
        for m in info.models:
            if m.owner is not None:
                render_owner(console, m.model, m.owner)
    buckets = [b for topic in info.topics for b in topic.buckets]
    if buckets:
        topics = Table(title="Queue topics", title_justify="left")
        topics.add_column("topic", overflow="fold")
        for column in ("bucket", "rows", "offsets", "versions", "fragments", "bytes"):
            topics.add_column(column, justify="right")
        for b in buckets:
            topics.add_row(
                escape(b.topic),
                str(b.bucket),
                f"{b.rows:,}",
                f"{b.first_offset:,}..{b.end_offset:,}",
                f"{b.versions:,}",
                f"{b.fragments:,}",
                human_bytes(b.bytes),
            )
            if b.note:
                notes.append(f"{b.topic} bucket {b.bucket}: {b.note}")
        console.print(topics)
    lags = [c for b in buckets for c in b.consumers]
    if lags:
        render_lags(console, lags)
    for note in notes:
        console.print(f"[yellow]Note:[/] {escape(note)}", highlight=False)


#: An L2 adapter's status fields ``inspect`` and ``stats`` show, in this order.
_ADAPTER_FIGURES = (
    "state",
    "is_healthy",
    "stored_object_count",
    "used_bytes",
    "capacity_bytes",
    "checksum_failures",
    "evictions",
    "store_failures",
    "load_failures",
    "load_misses",
    "layout_mismatches",
    "locked_key_count",
    "expired_locks",
    "io_errors",
)


def render_owner(console: Console, model: str, owner: dict[str, Any]) -> None:
    """Who serves ``model`` (live or when it last ran) and, for an L2 adapter, its
    capacity, usage and counters as it last recorded them."""
    import time

    state = "serving now" if owner.get("live") else "not running (last record)"
    console.print(
        f"[bold]{escape(model)}[/]: {escape(str(owner.get('what', owner.get('role'))))}, "
        f"pid {owner.get('pid')} on {escape(str(owner.get('host')))}, {state}.",
        highlight=False,
    )
    details = owner.get("details") or {}
    status = details.get("status")
    if not isinstance(status, dict):
        return
    age = time.time() - float(details.get("status_time", time.time()))
    table = Table(
        title=f"L2 adapter of {escape(model)} (status {age:,.0f} s old; counters since it started)",
        title_justify="left",
    )
    table.add_column("figure (LMCache /status name)")
    table.add_column("value", justify="right")
    for name in _ADAPTER_FIGURES:
        if name in status:
            value = status[name]
            shown = human_bytes(value) if name.endswith("_bytes") else f"{value}"
            table.add_row(name, shown)
    console.print(table)
    console.print(
        "[dim]used_bytes: what the capacity counts (payload files in 4 KiB blocks plus "
        "the metadata), the same figure LMCache reports.[/]"
    )


def render_lags(console: Console, lags: list[ConsumerLag]) -> None:
    table = Table(title="Queue consumers (lag in records)", title_justify="left")
    table.add_column("topic", overflow="fold")
    table.add_column("bucket", justify="right")
    table.add_column("consumer", overflow="fold")
    for column in ("position", "end", "lag"):
        table.add_column(column, justify="right")
    for c in lags:
        table.add_row(
            escape(c.topic),
            str(c.bucket),
            escape(c.consumer),
            count(c.position),
            count(c.end_offset),
            f"{c.lag:,}",
        )
    console.print(table)


def require_model(store: StorageRoot, model: str) -> None:
    """Fail (exit 1) unless ``model`` has a namespace under ``store`` (``kv_path`` refuses
    path-unsafe names), naming the models there."""
    if not store.kv_path(model).exists():
        known = ", ".join(store.list_models()) or "none"
        fail(f"no model {model!r} under {store.root} (models: {known})")


def confirm(verb: str, done: str, what: str) -> None:
    """Ask on a terminal whether to ``verb`` ``what``; refuse elsewhere (exit 2: --yes is
    required) and when the answer is no (nothing ``done``)."""
    if not sys.stdin.isatty():
        fail(f"refusing to {verb} {what} without --yes", EXIT_BAD_INPUT)
    if not typer.confirm(f"{verb.capitalize()} {what}?", default=False, err=True):
        fail(f"nothing {done}")


@command(app, "drop", rich_help_panel="Storage root")
def drop(
    model: Annotated[str, typer.Argument(help="Model namespace to remove, e.g. org/model.")],
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Do not ask; required when not on a terminal.")
    ] = False,
    storage_path: StoragePathOption = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Remove a model namespace whole: every chunk, its metadata, its files.

    Stop the servers that serve the model first: a live server keeps its index in memory.
    """
    from persisting.admin import drop_model, inspect_model

    store = open_storage_root(storage_path, config, writes="drop removes files")
    require_model(store, model)
    if not yes:
        info = inspect_model(store, model)
        what = (
            f"model {model!r} ({info.chunks:,} chunk(s), {human_bytes(info.bytes)}) "
            f"under {store.root}"
        )
        confirm("drop", "dropped", what)
    result = drop_model(store, model)

    def render(console: Console) -> None:
        console.print(
            f"Dropped {escape(model)}: {result.chunks:,} chunk(s), {human_bytes(result.bytes)}.",
            highlight=False,
        )

    emit(result, json_out, render)


@command(app, "quarantine", rich_help_panel="Storage root")
def quarantine(
    model: Annotated[str, typer.Argument(help="Model namespace, e.g. org/model.")],
    add_key: Annotated[
        Path | None,
        typer.Option(
            "--add-key",
            help="Add this key file (another root's kv/.secret or kv/.keys/ID) to the root's"
            " keys: the files sealed with it come back when a store next opens the model.",
        ),
    ] = None,
    delete: Annotated[
        bool, typer.Option("--delete", help="Delete every quarantined file of the model.")
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Do not ask; required when not on a terminal.")
    ] = False,
    storage_path: StoragePathOption = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Show the payload files a model's namespace set aside (never served, never deleted by
    a store, outside its budget); add the key they were sealed with, or delete them."""
    from persisting.admin.quarantine import (
        add_root_key,
        delete_quarantined,
        quarantine_of,
    )

    writes = "--add-key and --delete change the root" if (add_key or delete) else None
    store = open_storage_root(storage_path, config, writes=writes)
    require_model(store, model)
    report = quarantine_of(store, model)
    if add_key is not None:
        report.added_key = add_root_key(store, add_key)
    if delete and report.files:
        what = f"{report.files:,} quarantined file(s) ({human_bytes(report.bytes)}) of {model!r}"
        if not yes:
            confirm("delete", "deleted", what)
        report.deleted_files, report.deleted_bytes = delete_quarantined(store, model)

    def render(console: Console) -> None:
        console.print(
            f"{escape(model)}: {report.files:,} file(s), {human_bytes(report.bytes)} in"
            f" quarantine ({escape(str(report.path))}).",
            highlight=False,
        )
        if report.added_key:
            console.print(f"Added key {report.added_key}: matching files return at next open.")
        if report.deleted_files:
            console.print(
                f"Deleted {report.deleted_files:,} file(s), {human_bytes(report.deleted_bytes)}."
            )

    emit(report, json_out, render)


@command(app, "compact", rich_help_panel="Storage root")
def compact(
    models: Annotated[
        list[str] | None,
        typer.Argument(help="Models whose metadata to compact (default: every model and topic)."),
    ] = None,
    topic: Annotated[
        list[str] | None, typer.Option("--topic", help="A queue topic to compact (repeatable).")
    ] = None,
    older_than: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Keep old versions younger than this many seconds, for readers still on them; "
            "0 frees them all at once (nothing else running).",
        ),
    ] = 10.0,
    storage_path: StoragePathOption = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Compact KV metadata tables and queue buckets, then delete their old versions.

    Refused while a model it would compact is served by a live server or L2 adapter
    (named in the message): stop it first, or compact only queue topics (--topic).
    """
    from persisting.admin import compact_dataset, compaction_targets, refuse_live

    store = open_storage_root(storage_path, config, writes="compact rewrites metadata")
    targets = compaction_targets(store, models or (), topic or ())
    refuse_live(store, targets)
    results = []
    with progress_bar("compacting", len(targets)) as advance:
        for target in targets:
            results.append(compact_dataset(store, target, timedelta(seconds=older_than)))
            advance()
    data = {
        "root": store.root,
        "bytes_before": sum(r.bytes_before for r in results),
        "bytes_after": sum(r.bytes_after for r in results),
        "datasets": results,
    }
    emit(data, json_out, lambda console: render_compact(console, results))
    failed = [r for r in results if r.error]
    if failed:
        fail(f"{len(failed)} dataset(s) could not be compacted: {failed[0].error}")


def render_compact(console: Console, results: list[CompactionResult]) -> None:
    if not results:
        console.print("Nothing to compact.")
        return
    table = Table(title="Compaction", title_justify="left")
    table.add_column("dataset")
    for column in ("fragments", "versions", "bytes before", "bytes after"):
        table.add_column(column, justify="right")
    for r in results:
        name = f"kv {r.name}" if r.kind == "kv" else f"queue {r.name} bucket {r.bucket}"
        if r.error:
            table.add_row(escape(name), "[red]failed[/]", "", human_bytes(r.bytes_before), "")
            continue
        table.add_row(
            escape(name),
            f"{r.fragments_before} -> {r.fragments_after}",
            f"{r.versions_before} -> {r.versions_after}",
            human_bytes(r.bytes_before),
            human_bytes(r.bytes_after),
        )
    console.print(table)
    before = sum(r.bytes_before for r in results)
    after = sum(r.bytes_after for r in results)
    console.print(
        f"{len(results)} dataset(s): {human_bytes(before)} -> {human_bytes(after)}.",
        highlight=False,
    )


@command(app, "stats", rich_help_panel="Storage root")
def stats(
    storage_path: StoragePathOption = None,
    metrics_url: Annotated[
        str | None,
        typer.Option(help="A running server's metrics, e.g. http://127.0.0.1:9464/metrics."),
    ] = None,
    service: Annotated[
        list[str] | None,
        typer.Option(
            "--service",
            help="A server of a running service, IP:PORT (repeatable: any live one finds "
            "the cluster): shows every member, its state and figures.",
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="With --service: the service's actor name.")
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for --metrics-url or --service.")
    ] = 10.0,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Store figures: hits, misses, bytes per tier, evictions, damage, latency, queue lag.

    From a running server's Prometheus endpoint (--metrics-url: its traffic and latency
    percentiles), from a running cluster (--service: every member, its state and figures),
    or from a storage root (what is stored, read without changing anything; traffic
    counters live in the processes serving it).
    """
    from persisting.admin import figures_from_scrape, root_stats, scrape

    sources = {"--storage-path": storage_path, "--metrics-url": metrics_url, "--service": service}
    given = [flag for flag, value in sources.items() if value]
    if len(given) > 1:
        fail(
            f"give one of --storage-path, --metrics-url and --service, not both {given[0]} "
            f"and {given[1]}",
            EXIT_BAD_INPUT,
        )
    if service:
        cluster_stats(service, name, timeout, config, json_out)
        return
    if metrics_url is not None:
        report = figures_from_scrape(scrape(metrics_url, timeout), metrics_url)
    else:
        store = open_storage_root(storage_path, config)  # only read: nothing is opened to write
        with progress_bar("reading namespaces", len(store.list_models())) as advance:
            report = root_stats(store, on_model=advance)
    emit(report.to_dict(), json_out, lambda console: render_stats(console, report))


def cluster_stats(
    seeds: list[str], name: str | None, timeout: float, config: Path | None, json_out: bool
) -> None:
    """``stats --service``: the members of a running service and their figures."""
    import asyncio

    from persisting.config import socket_address
    from persisting.pulsing_compat import exit_after_shutdown
    from persisting.service.client.survey import survey_cluster

    for seed in seeds:
        socket_address(seed, "--service")
    settings = load_settings(config)
    view = asyncio.run(survey_cluster(seeds, name=name, settings=settings, timeout_s=timeout))
    emit(view, json_out, lambda console: render_cluster(console, view))
    exit_after_shutdown()  # Pulsing may crash at interpreter exit after a shutdown


def render_cluster(console: Console, view: ClusterView) -> None:
    console.print(
        f"Service {escape(view.name)!r}: {view.up} of {len(view.members)} member(s) up "
        f"(found through {escape(', '.join(view.seeds))}).",
        highlight=False,
    )
    table = Table(title="Members", title_justify="left")
    table.add_column("member", overflow="fold")
    table.add_column("state")
    for column in ("pid", "sessions", "requests", "errors", "events applied"):
        table.add_column(column, justify="right")
    for m in view.members:
        up = m.state == "up"
        requests = sum(v for k, v in m.service.items() if k.startswith("op_"))
        events = m.events or {}
        table.add_row(
            escape(m.addr),
            "[green]up[/]" if up else f"[red]{escape(m.state)}[/]",
            str(m.node.get("pid", "-")),
            count(m.service.get("sessions")),
            f"{requests:,}" if up else "-",
            count(m.service.get("errors", 0) if up else None),
            f"{int(events.get('applied', 0)):,}" if m.events is not None else "-",
        )
    console.print(table)
    figures = Table(title="Stores per member", title_justify="left")
    figures.add_column("member", overflow="fold")
    figures.add_column("model", overflow="fold")
    for column in ("chunks", "stored", "get hits", "get misses", "hit tokens"):
        figures.add_column(column, justify="right")
    for m in view.members:
        for model, st in sorted(m.stores.items()):
            figures.add_row(
                escape(m.addr),
                escape(model),
                f"{int(st.get('disk_items', st.get('memory_items', 0))):,}",
                human_bytes(int(st.get("disk_bytes", st.get("memory_bytes", 0)))),
                f"{int(st.get('get_hit', 0)):,}",
                f"{int(st.get('get_miss', 0)):,}",
                f"{int(st.get('lookup_hit_tokens', 0)):,}",
            )
    if figures.row_count:
        console.print(figures)
    for m in view.members:
        if m.error:
            console.print(f"[yellow]{escape(m.addr)}[/]: {escape(m.error)}", highlight=False)


#: Figures shown in binary byte units.
_BYTE_FIGURES = frozenset({"read_bytes", "written_bytes", "bytes", "capacity"})


def render_stats(console: Console, report: StatsReport) -> None:
    from persisting.metrics import STORE_FIGURES

    counters = {f.field for f in STORE_FIGURES if f.kind == "counter"}
    where = "server metrics at" if report.kind == "metrics_url" else "storage root"
    console.print(f"Figures from {where} {escape(report.source)}.", highlight=False)
    if report.kind == "storage_root":
        console.print(
            "[dim]What is stored, read from the files; traffic counters live in the "
            "processes serving it: use --metrics-url for a server's or an engine's hits, "
            "bytes moved and latency.[/]"
        )
    if not report.models:
        console.print("No models.")
    for m in report.models:
        if m.error:
            console.print(f"[bold]{escape(m.model)}[/]: [red]{escape(m.error)}[/]")
            continue
        if m.describe:
            holds = escape(describe_namespace(m.describe))
            console.print(f"[dim]{escape(m.model)} holds {holds}[/]")
        table = Table(title=f"Model {escape(m.model)}", title_justify="left")
        table.add_column("figure (--json name)")
        for column in ("memory", "disk", "total"):
            table.add_column(column, justify="right")
        for name, value in m.figures.items():
            show = human_bytes if name in _BYTE_FIGURES else (lambda n: f"{n:,}")
            if isinstance(value, dict):
                cells = [show(value[t]) if t in value else "-" for t in ("memory", "disk")]
                # Counters add up across tiers; gauges do not (a chunk may be in both).
                total = show(sum(value.values())) if name in counters else ""
                table.add_row(name, *cells, total)
            else:
                table.add_row(name, "", "", show(value))
        console.print(table)
        console.print(
            "[dim]bytes (disk): what the disk capacity counts -- payload files in 4 KiB "
            "blocks plus the metadata table; `persisting inspect` shows what the files "
            "occupy (du).[/]"
        )
        if m.owner is not None:
            render_owner(console, m.model, m.owner)
        if m.latency:
            latency = Table(title=f"Latency of {escape(m.model)} (ms)", title_justify="left")
            for column in ("op", "tier", "outcome"):
                latency.add_column(column)
            for column in ("count", "mean", "p50", "p95", "p99"):
                latency.add_column(column, justify="right")
            for lat in m.latency:
                latency.add_row(
                    lat.op,
                    lat.tier,
                    lat.outcome,
                    f"{lat.count:,}",
                    human_ms(lat.mean_ms),
                    human_ms(lat.p50_ms),
                    human_ms(lat.p95_ms),
                    human_ms(lat.p99_ms),
                )
            console.print(latency)
    if report.queue_lag:
        render_lags(console, report.queue_lag)
