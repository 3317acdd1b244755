"""The ``persisting`` command line: the top of the house (it may import everything).

Adding a command: write a small function under its own section, register it with
``@command(app)`` (or ``@command(<sub-app>)``), take ``json_out: JsonFlag`` if a script
would want its output, and end with ``emit(data, json_out, render)``: the same data goes
to ``--json`` or to a rich rendering. ``command`` turns a :class:`PersistingError` into a
one-line message and an exit code (2 for bad input, 1 for everything else). Heavy imports
(torch, Lance, Pulsing) go inside the command that needs them, so ``--help`` and
``persisting plan`` stay instant.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass, replace
from datetime import timedelta
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from persisting.errors import PersistingError

if TYPE_CHECKING:
    from persisting.admin import CompactionResult, RootInfo, StatsReport
    from persisting.bench.replay import ReplayResult
    from persisting.bench.report import ReplayReport
    from persisting.config import PersistingSettings
    from persisting.lance_store import StorageRoot
    from persisting.metrics import ConsumerLag
    from persisting.planner import CapacityPlan

app = typer.Typer(
    help="Persisting: a tiered KV-cache store and a durable Lance queue.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(
    help="Trace-replay benchmark: generate a trace, replay it against a store, report.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

F = TypeVar("F", bound=Callable[..., Any])

# ---------------------------------------------------------------------------------------
# Shared options, output and error handling
# ---------------------------------------------------------------------------------------

JsonFlag = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")
]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="TOML settings file (else PERSISTING_CONFIG and PERSISTING_* variables).",
        exists=True,
        dir_okay=False,
    ),
]

#: Exit code of a command given impossible input (click's usage errors use it too).
EXIT_BAD_INPUT = 2
#: Exit code of a command that failed for any other reason Persisting knows about.
EXIT_FAILED = 1


def stdout() -> Console:
    """A console on the current stdout (made per call so test runners can capture it)."""
    return Console()


def stderr() -> Console:
    return Console(stderr=True)


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``Error: message`` on stderr and exit with ``code``."""
    stderr().print(f"[bold red]Error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def command(group: typer.Typer, name: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """Register a function as a command of ``group``, with Persisting errors made readable."""

    def register(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except PersistingError as exc:
                code = EXIT_BAD_INPUT if isinstance(exc, ValueError) else EXIT_FAILED
                fail(str(exc), code)

        group.command(name, **kwargs)(run)
        return fn

    return register


def to_jsonable(value: Any) -> Any:
    """Plain JSON data from dataclasses, paths and fractions (ints stay exact)."""
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else float(value)
    return value


def emit(data: Any, json_out: bool, render: Callable[[Console], None]) -> None:
    """``data`` as indented JSON on stdout when ``json_out``, else ``render`` it."""
    if json_out:
        typer.echo(json.dumps(to_jsonable(data), indent=2))
    else:
        render(stdout())


def load_settings(config: Path | None) -> PersistingSettings:
    from persisting.config import PersistingSettings

    return PersistingSettings.load(config)


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr (shown only on a terminal); yields ``advance()``."""
    console = stderr()
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: float) -> str:
    """``805306368`` -> ``768 MiB``: binary units, at most two decimals."""
    value = float(n)
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            text = f"{value:,.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_rate(n: float) -> str:
    """Bytes/s in binary units, with the decimal GB/s that NIC and disk specs use."""
    return f"{human_bytes(n)}/s = {n / 1e9:,.2f} GB/s"


def human_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:,.3f}"


# ---------------------------------------------------------------------------------------
# persisting plan
# ---------------------------------------------------------------------------------------


@command(app, "plan")
def plan(
    prefix_tokens: Annotated[int, typer.Option(help="Tokens in one shared prefix.")],
    prefixes: Annotated[int, typer.Option(help="Distinct prefixes the tier keeps.")],
    rps: Annotated[
        float, typer.Option(help="Requests/s; each reads its whole prefix from the tier.")
    ],
    layers: Annotated[int | None, typer.Option(help="Transformer layers.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="KV heads (GQA groups).")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Dimension of one head.")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="KV cache dtype: bf16, fp16, fp8, fp32 (default: bf16).")
    ] = None,
    bytes_per_token: Annotated[
        int | None,
        typer.Option(help="KV bytes per token, instead of the shape (MLA and other layouts)."),
    ] = None,
    chunk_size: Annotated[int, typer.Option(help="Tokens per stored chunk.")] = 256,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks; each stores its share.")] = 1,
    replicas: Annotated[int, typer.Option(help="Copies of every object.")] = 1,
    fill: Annotated[float, typer.Option(help="Share of the pool data may fill, in (0, 1].")] = 0.7,
    new_prefix_fraction: Annotated[
        float, typer.Option(help="Share of requests that write a new prefix, in [0, 1].")
    ] = 0.0,
    new_prefix_tokens: Annotated[
        int | None,
        typer.Option(help="Tokens in a newly written prefix (default: --prefix-tokens)."),
    ] = None,
    staging_ms: Annotated[
        float, typer.Option(help="Average time data stays in staging buffers (ms).")
    ] = 100.0,
    nic_gbps: Annotated[float, typer.Option(help="NIC line rate in Gbit/s.")] = 200.0,
    nic_efficiency: Annotated[
        float, typer.Option(help="Share of line rate usable in practice, in (0, 1].")
    ] = 0.7,
    json_out: JsonFlag = False,
) -> None:
    """Capacity and bandwidth budget of a shared KV tier (exact bytes; see docs/capacity.md)."""
    from persisting.planner import plan_capacity

    result = plan_capacity(
        prefix_tokens=prefix_tokens,
        prefixes=prefixes,
        bytes_per_token=bytes_per_token,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
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
    emit(result.to_dict(), json_out, lambda console: render_plan(console, result))


def render_plan(console: Console, result: CapacityPlan) -> None:
    """The plan as a table: figure, human value, exact value, how it is worked out."""
    from persisting.planner import PLAN_LINES

    i = result.inputs
    model = (
        "{layers} layers x {kv_heads} KV heads x head dim {head_dim}, {dtype}".format(
            **i.model_shape
        )
        if i.model_shape
        else f"{i.bytes_per_token:,} bytes per token (given)"
    )
    console.print(
        f"[bold]Model:[/] {model}. [bold]Workload:[/] {i.prefixes:,} prefixes of "
        f"{i.prefix_tokens:,} tokens, chunk {i.chunk_size}, TP {i.tp}, {i.replicas} replica(s), "
        f"fill {float(i.fill):g}, {float(i.rps):g} req/s, "
        f"{float(i.new_prefix_fraction):g} of them writing {i.new_prefix_tokens:,}-token "
        f"prefixes, staging {float(i.staging_ms):g} ms, NIC {float(i.nic_gbps):g} Gbps at "
        f"{float(i.nic_efficiency):g}.",
        highlight=False,
    )
    table = Table(title="Capacity and bandwidth budget", title_justify="left")
    table.add_column("Figure (--json name)", no_wrap=True)
    table.add_column("Value (exact below)", justify="right", no_wrap=True)
    table.add_column("How it is worked out")
    for line in PLAN_LINES:
        value = getattr(result, line.name)
        meaning = line.meaning
        if line.name == "bytes_per_token" and i.model_shape is None:
            meaning = "given directly (--bytes-per-token)"
        table.add_row(line.name, _plan_value(value, line.unit), meaning)
    console.print(table)
    headroom = result.nic_headroom
    if headroom is None:
        console.print("No reads (rps is 0): NIC headroom does not apply.")
    elif headroom < 1:
        console.print("[bold red]Reads alone exceed the usable NIC bandwidth.[/]")
    elif headroom < 1.5:
        console.print(
            "[yellow]Under 1.5x NIC headroom: little room for bursts, failures and "
            "re-replication.[/]"
        )


def _plan_value(value: int | float | None, unit: str) -> str:
    """A human value, with the exact figure on a dim second line where they differ."""
    if value is None:
        return "n/a (no reads)"
    if unit == "ratio":
        return f"{value:.2f}x"
    if unit == "count":
        return f"{value:,}"
    if unit == "count/s":
        return f"{value:,} /s"
    human = human_bytes(value) if unit == "bytes" else human_rate(value)
    if value < 1024:
        return human
    return f"{human}\n[dim]{value:,} B{'/s' if unit == 'bytes/s' else ''}[/]"


# ---------------------------------------------------------------------------------------
# persisting bench generate / replay
# ---------------------------------------------------------------------------------------


@command(bench_app, "generate")
def bench_generate(
    out: Annotated[Path, typer.Argument(help="JSONL trace file to write.", dir_okay=False)],
    requests: Annotated[int, typer.Option(help="Requests in the trace.")] = 200,
    rate: Annotated[float, typer.Option(help="Arrival rate, requests/s.")] = 20.0,
    arrival: Annotated[str, typer.Option(help="Arrival process: poisson or uniform.")] = "poisson",
    documents: Annotated[int, typer.Option(help="Distinct shared document prefixes.")] = 50,
    zipf_s: Annotated[float, typer.Option(help="Zipf exponent of document popularity.")] = 1.0,
    doc_tokens: Annotated[int, typer.Option(help="Tokens per document prefix.")] = 2048,
    suffix_tokens: Annotated[int, typer.Option(help="Unique tokens per request.")] = 256,
    system_tokens: Annotated[int, typer.Option(help="System prompt shared by all.")] = 0,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same trace).")] = 0,
    model: Annotated[str, typer.Option(help="Model namespace to replay into.")] = (
        "bench/synthetic"
    ),
    vocab_size: Annotated[int, typer.Option(help="Token ids are drawn below this.")] = 32000,
    json_out: JsonFlag = False,
) -> None:
    """Write a synthetic trace: Zipf-popular shared documents plus unique suffixes."""
    from persisting.bench.trace import TraceSpec, generate_trace, write_trace

    spec = TraceSpec(
        requests=requests,
        rate=rate,
        arrival=arrival,  # type: ignore[arg-type]  # validated by the spec
        documents=documents,
        zipf_s=zipf_s,
        doc_tokens=doc_tokens,
        suffix_tokens=suffix_tokens,
        system_tokens=system_tokens,
        seed=seed,
        model=model,
        vocab_size=vocab_size,
    )
    trace = generate_trace(spec)
    write_trace(trace, out)
    docs = [r.meta["doc"] for r in trace.requests]
    top_share = max(docs.count(d) for d in set(docs)) / len(docs)
    summary = {
        "path": out,
        "requests": len(trace.requests),
        "duration_s": trace.duration_s,
        "tokens": sum(r.num_tokens for r in trace.requests),
        "distinct_documents": len(set(docs)),
        "top_document_share": top_share,
        "spec": spec,
    }

    def render(console: Console) -> None:
        console.print(
            f"Wrote {summary['requests']:,} requests over {trace.duration_s:.1f} s "
            f"({summary['tokens']:,} tokens, {summary['distinct_documents']} distinct "
            f"documents, the most popular in {top_share:.0%} of requests) to {out}",
            highlight=False,
        )

    emit(summary, json_out, render)


@command(bench_app, "replay")
def bench_replay(
    trace_file: Annotated[
        Path, typer.Argument(help="JSONL trace to replay.", exists=True, dir_okay=False)
    ],
    storage_path: Annotated[
        Path | None,
        typer.Option(help="Storage root to use and keep (default: a temporary one, removed)."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model namespace (default: the trace's).")
    ] = None,
    memory_bytes: Annotated[
        int | None, typer.Option(help="Memory tier budget in bytes (default: settings).")
    ] = None,
    disk_bytes: Annotated[
        int | None, typer.Option(help="Disk tier budget in bytes (default: settings).")
    ] = None,
    durability: Annotated[
        str | None,
        typer.Option(help="Put completion: sync, async or write_back (default: settings)."),
    ] = None,
    chunk_size: Annotated[
        int | None, typer.Option(help="Tokens per chunk (default: settings).")
    ] = None,
    bytes_per_token: Annotated[
        int, typer.Option(help="KV bytes per token of the bench values (small = fast).")
    ] = 1024,
    layers: Annotated[int, typer.Option(help="Layers of the bench values.")] = 1,
    realtime: Annotated[
        bool, typer.Option(help="Pace requests at trace times instead of back to back.")
    ] = False,
    verify: Annotated[bool, typer.Option(help="Check every loaded chunk's contents.")] = True,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG: latency CDF and hit rate over time.")
    ] = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Replay a trace against a local store; report hit rates, bytes and p50/p95/p99."""
    from persisting.bench.replay import ReplayOptions, replay
    from persisting.bench.report import summarize
    from persisting.bench.targets import open_local_target
    from persisting.bench.trace import read_trace

    settings = load_settings(config)
    trace = read_trace(trace_file)
    if model:
        trace = replace(trace, header=replace(trace.header, model=model))
    options = ReplayOptions(
        chunk_size=chunk_size or settings.kv.chunk_size,
        bytes_per_token=bytes_per_token,
        layers=layers,
        realtime=realtime,
        verify=verify,
    )
    with _storage_root(storage_path) as root:
        target = open_local_target(
            root,
            trace.header.model,
            settings=settings,
            memory_bytes=memory_bytes,
            disk_bytes=disk_bytes,
            durability=durability,
        )
        try:
            with progress_bar("replaying", len(trace.requests)) as advance:
                result = replay(
                    trace,
                    target,
                    options,
                    target_name=f"local store at {root}" if storage_path else "local store",
                    on_request=lambda _record: advance(),
                )
        finally:
            target.close()
    report = summarize(result)
    if plot is not None:
        from persisting.bench.plot import write_plot

        write_plot(result, plot)
    data = {**report.to_dict(), "plot": plot}
    emit(data, json_out, lambda console: render_replay(console, report, result, plot))
    if report.mismatches:
        fail(f"{report.mismatches} loaded chunk(s) did not match what was stored")


@contextmanager
def _storage_root(path: Path | None) -> Iterator[Path]:
    """``path``, or a temporary root that is removed afterwards."""
    if path is not None:
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="persisting-bench-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render_replay(
    console: Console, report: ReplayReport, result: ReplayResult, plot: Path | None
) -> None:
    console.print(
        f"Replayed {report.requests:,} requests into {report.model} on {report.target} in "
        f"{report.wall_s:.2f} s ({report.requests_per_s:,.1f} req/s).",
        highlight=False,
    )
    summary = Table(title="Hits and bytes", title_justify="left")
    summary.add_column("Figure")
    summary.add_column("Value", justify="right")
    summary.add_row("token hit rate", f"{report.token_hit_rate:.1%}")
    summary.add_row("hit tokens", f"{report.hit_tokens:,} of {report.tokens:,}")
    summary.add_row("chunk hit rate", f"{report.chunk_hit_rate:.1%}")
    summary.add_row("requests with a hit", f"{report.requests_with_hits:,}")
    summary.add_row("bytes read", human_bytes(report.bytes_read))
    summary.add_row("bytes written", human_bytes(report.bytes_written))
    summary.add_row("get throughput", human_rate(report.get_bytes_per_s))
    summary.add_row("put throughput", human_rate(report.put_bytes_per_s))
    summary.add_row("mismatched chunks", f"{report.mismatches:,}")
    console.print(summary)
    latency = Table(title="Latency per request (ms)", title_justify="left")
    for column in ("op", "count", "mean", "p50", "p95", "p99", "max"):
        latency.add_column(column, justify="left" if column == "op" else "right")
    for op, stats in report.ops.items():
        latency.add_row(
            op,
            f"{stats.count:,}",
            human_ms(stats.mean_ms),
            human_ms(stats.p50_ms),
            human_ms(stats.p95_ms),
            human_ms(stats.p99_ms),
            human_ms(stats.max_ms),
        )
    console.print(latency)
    if plot is not None:
        console.print(f"Plot written to {plot}", highlight=False)


# ---------------------------------------------------------------------------------------
# persisting inspect | drop | compact | stats: operating a storage root and a server
# ---------------------------------------------------------------------------------------

StoragePathOption = Annotated[
    Path | None,
    typer.Option("--storage-path", help="Storage root (default: the settings' storage_path)."),
]


def open_storage_root(storage_path: Path | None, config: Path | None) -> StorageRoot:
    """The root named by ``--storage-path``, else by the settings; it must exist."""
    from persisting.admin import open_root

    return open_root(storage_path or load_settings(config).storage_path)


@command(app, "inspect")
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
        for column in ("chunks", "bytes", "meta rows", "versions", "fragments"):
            models.add_column(column, justify="right")
        for m in info.models:
            models.add_row(
                escape(m.model),
                f"{m.chunks:,}",
                human_bytes(m.bytes),
                _count(m.meta_rows),
                _count(m.meta_versions),
                _count(m.meta_fragments),
            )
            if m.note:
                notes.append(f"{m.model}: {m.note}")
        console.print(models)
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
            _count(c.position),
            _count(c.end_offset),
            f"{c.lag:,}",
        )
    console.print(table)


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


@command(app, "drop")
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

    store = open_storage_root(storage_path, config)
    if not store.kv_path(model).exists():  # kv_path rejects path-unsafe names
        known = ", ".join(store.list_models()) or "none"
        fail(f"no model {model!r} under {store.root} (models: {known})")
    if not yes:
        info = inspect_model(store, model)
        what = (
            f"model {model!r} ({info.chunks:,} chunk(s), {human_bytes(info.bytes)}) "
            f"under {store.root}"
        )
        if not sys.stdin.isatty():
            fail(f"refusing to drop {what} without --yes", EXIT_BAD_INPUT)
        if not typer.confirm(f"Drop {what}?", default=False, err=True):
            fail("nothing dropped")
    result = drop_model(store, model)

    def render(console: Console) -> None:
        console.print(
            f"Dropped {escape(model)}: {result.chunks:,} chunk(s), {human_bytes(result.bytes)}.",
            highlight=False,
        )

    emit(result, json_out, render)


@command(app, "compact")
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
    """Compact KV metadata tables and queue buckets, then delete their old versions."""
    from persisting.admin import compact_dataset, compaction_targets

    store = open_storage_root(storage_path, config)
    targets = compaction_targets(store, models or (), topic or ())
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


@command(app, "stats")
def stats(
    storage_path: StoragePathOption = None,
    metrics_url: Annotated[
        str | None,
        typer.Option(help="A running server's metrics, e.g. http://127.0.0.1:9464/metrics."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for --metrics-url.")] = 10.0,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Store figures: hits, misses, bytes per tier, evictions, damage, latency, queue lag.

    From a running server's Prometheus endpoint (--metrics-url: its traffic and latency
    percentiles), or from a storage root (what is stored; counters start at zero).
    """
    from persisting.admin import figures_from_scrape, root_stats, scrape

    if storage_path is not None and metrics_url is not None:
        fail("give --storage-path or --metrics-url, not both", EXIT_BAD_INPUT)
    if metrics_url is not None:
        report = figures_from_scrape(scrape(metrics_url, timeout), metrics_url)
    else:
        settings = load_settings(config)
        store = open_storage_root(storage_path or settings.storage_path, None)
        with progress_bar("opening stores", len(store.list_models())) as advance:
            report = root_stats(store, settings, on_model=advance)
    emit(report.to_dict(), json_out, lambda console: render_stats(console, report))


#: Figures shown in binary byte units.
_BYTE_FIGURES = frozenset({"read_bytes", "written_bytes", "bytes", "capacity"})


def render_stats(console: Console, report: StatsReport) -> None:
    from persisting.metrics import STORE_FIGURES

    counters = {f.field for f in STORE_FIGURES if f.kind == "counter"}
    where = "server metrics at" if report.kind == "metrics_url" else "storage root"
    console.print(f"Figures from {where} {escape(report.source)}.", highlight=False)
    if report.kind == "storage_root":
        console.print(
            "[dim]Counters count this process's traffic (none yet): use --metrics-url for a "
            "server's hits, bytes moved and latency.[/]"
        )
    if not report.models:
        console.print("No models.")
    for m in report.models:
        if m.error:
            console.print(f"[bold]{escape(m.model)}[/]: [red]{escape(m.error)}[/]")
            continue
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


# ---------------------------------------------------------------------------------------
# serve, demo, prewarm: the actor service (persisting/actors/)
# ---------------------------------------------------------------------------------------


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


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
    log_level: str | None = None,
    log_json: bool = False,
) -> PersistingSettings:
    settings = load_settings(config)
    update: dict[str, Any] = {}
    if storage_path is not None:
        update["storage_path"] = storage_path
    if models:
        update["models"] = list(models)
    flags = {
        "metrics_port": metrics_port,
        "passphrase": passphrase,
        "log_level": log_level,
        "log_format": "json" if log_json else None,
    }
    service = settings.service.model_copy(update={k: v for k, v in flags.items() if v is not None})
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
    log_level: Annotated[
        LogLevel | None, typer.Option(help="Server log level (default: settings, info).")
    ] = None,
    log_json: Annotated[
        bool, typer.Option("--log-json", help="Log one JSON object per line.")
    ] = False,
    config: ConfigOption = None,
) -> None:
    """Serve the KV store as a Pulsing actor until Ctrl-C (embedded storage root by default).

    With no passphrase configured it generates one, which clients of the same user on this
    host find by themselves, and serves loopback only (see docs/service.md).
    """
    from persisting.actors.launch import serve as serve_forever

    settings = _service_settings(
        config,
        storage_path,
        model,
        metrics_port,
        passphrase,
        log_level.value if log_level is not None else None,
        log_json,
    )
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

    from persisting.actors.launch import run_demo

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
    from persisting.actors.kv_events import prewarm as publish

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


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def main() -> None:
    """Console-script entry point (``persisting = persisting.cli:main``)."""
    app(prog_name="persisting")


if __name__ == "__main__":
    main()
