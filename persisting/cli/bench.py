"""``persisting bench generate | replay``: synthetic traces, replayed against a local store
or a running server, with values the size of a real model's KV."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from persisting.cli.app import ConfigOption, JsonFlag, bench_app, command, fail, load_settings
from persisting.cli.checks import module_for, output_file, storage_folder
from persisting.cli.output import emit, human_bytes, human_ms, human_rate, progress_bar
from persisting.config import parse_bytes, socket_address
from persisting.errors import ConfigError

if TYPE_CHECKING:
    from persisting.bench.replay import ReplayOptions, ReplayResult
    from persisting.bench.report import ReplayReport
    from persisting.config import PersistingSettings

#: The model a generated trace is for, and whose KV size a replay's values take.
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"


@command(bench_app, "generate")
def bench_generate(
    out: Annotated[Path, typer.Argument(help="JSONL trace file to write.", dir_okay=False)],
    requests: Annotated[int, typer.Option(help="Requests in the trace.")] = 200,
    rate: Annotated[float, typer.Option(help="Arrival rate, requests/s.")] = 20.0,
    arrival: Annotated[str, typer.Option(help="Arrival process: poisson or uniform.")] = "poisson",
    documents: Annotated[int, typer.Option(help="Distinct shared document prefixes.")] = 20,
    zipf_s: Annotated[float, typer.Option(help="Zipf exponent of document popularity.")] = 1.0,
    doc_tokens: Annotated[int, typer.Option(help="Tokens per document prefix.")] = 1024,
    suffix_tokens: Annotated[
        int,
        typer.Option(help="Unique tokens per request (under a chunk: never stored)."),
    ] = 128,
    system_tokens: Annotated[int, typer.Option(help="System prompt shared by all.")] = 0,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same trace).")] = 0,
    model: Annotated[
        str,
        typer.Option(
            help="Model namespace to replay into; a known model also sets the replay's KV size."
        ),
    ] = DEFAULT_MODEL,
    vocab_size: Annotated[int, typer.Option(help="Token ids are drawn below this.")] = 32000,
    json_out: JsonFlag = False,
) -> None:
    """Write a synthetic trace: Zipf-popular shared documents plus unique suffixes."""
    from persisting.bench.trace import TraceSpec, generate_trace, write_trace

    output_file(out, "OUT")
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
    server: Annotated[
        list[str] | None,
        typer.Option(
            help="Replay against a running service at IP:PORT instead of a local store "
            "(repeatable: list several servers, and any live one finds the cluster)."
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="The server's actor name (default: settings).")
    ] = None,
    storage_path: Annotated[
        Path | None,
        typer.Option(help="Local store's root, kept (default: a temporary one, removed)."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model namespace (default: the trace's).")
    ] = None,
    kv_model: Annotated[
        str | None,
        typer.Option(
            help="Model whose KV size the values take, e.g. llama-3.1-8b (default: the "
            "trace's model when it is a known one)."
        ),
    ] = None,
    bytes_per_token: Annotated[
        int | None, typer.Option(help="KV bytes per token of the values, instead of --kv-model.")
    ] = None,
    layers: Annotated[
        int | None, typer.Option(help="Layers of the values (with --bytes-per-token).")
    ] = None,
    memory_bytes: Annotated[
        str | None, typer.Option(help="Local memory tier budget, e.g. 8GiB (default: settings).")
    ] = None,
    disk_bytes: Annotated[
        str | None, typer.Option(help="Local disk tier budget, e.g. 64GiB (default: settings).")
    ] = None,
    durability: Annotated[
        str | None,
        typer.Option(help="Local put completion: sync, async or write_back (default: settings)."),
    ] = None,
    chunk_size: Annotated[
        int | None, typer.Option(help="Tokens per chunk (default: settings).")
    ] = None,
    realtime: Annotated[
        bool, typer.Option(help="Pace requests at trace times instead of back to back.")
    ] = False,
    verify: Annotated[bool, typer.Option(help="Check every loaded chunk's contents.")] = True,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write a PNG: latency CDF, hits by tier over time, best achievable."),
    ] = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Replay a trace against a local store (or --server); report hit rates by tier, the
    best achievable hit rate, bytes and p50/p95/p99."""
    from persisting.bench.replay import replay
    from persisting.bench.report import summarize
    from persisting.bench.trace import read_trace

    if plot is not None:  # checked before the work, not after it
        output_file(plot, "--plot")
        module_for("--plot", "matplotlib", "pip install matplotlib")
    local_flags = {
        "--storage-path": storage_path,
        "--memory-bytes": memory_bytes,
        "--disk-bytes": disk_bytes,
        "--durability": durability,
    }
    if server:
        for addr in server:
            socket_address(addr, "--server")
        given = [flag for flag, value in local_flags.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} set a local store: not with --server")
    elif storage_path is not None:
        storage_folder(storage_path)
    sizes = {
        "memory_bytes": _size(memory_bytes, "--memory-bytes"),
        "disk_bytes": _size(disk_bytes, "--disk-bytes"),
    }
    settings = load_settings(config)
    trace = read_trace(trace_file)
    if model:
        trace = replace(trace, header=replace(trace.header, model=model))
    options = _values(
        kv_model or (None if bytes_per_token else trace.header.model),
        bytes_per_token,
        layers,
        chunk_size=chunk_size or settings.kv.chunk_size,
        realtime=realtime,
        verify=verify,
    )
    opened = _target(server, name, storage_path, trace.header.model, settings, sizes, durability)
    with (
        opened as (target, label, tier_hits),
        progress_bar("replaying", len(trace.requests)) as advance,
    ):
        result = replay(
            trace,
            target,
            options,
            target_name=label,
            on_request=lambda _record: advance(),
            tier_hits=tier_hits,
        )
    report = summarize(result)
    if plot is not None:
        from persisting.bench.plot import write_plot

        write_plot(result, plot)
    data = {**report.to_dict(), "plot": plot}
    emit(data, json_out, lambda console: render_replay(console, report, result, plot))
    if report.mismatches:
        fail(f"{report.mismatches} loaded chunk(s) did not match what was stored")


def _size(value: str | None, flag: str) -> int | None:
    if value is None:
        return None
    try:
        return int(parse_bytes(value))
    except ValueError:
        raise ConfigError(f"{flag} must be a size such as 8GiB or 512MB, got {value!r}") from None


def _values(
    kv_model: str | None, bytes_per_token: int | None, layers: int | None, **options: Any
) -> ReplayOptions:
    """Replay options whose values weigh a model's KV (``--kv-model``), or a given size."""
    from persisting.bench.replay import ReplayOptions

    if bytes_per_token is not None:
        if kv_model is not None:
            raise ConfigError("give --kv-model or --bytes-per-token, not both")
        return ReplayOptions(bytes_per_token=bytes_per_token, layers=layers or 1, **options)
    if layers is not None:
        raise ConfigError("--layers goes with --bytes-per-token")
    assert kv_model is not None
    try:
        return ReplayOptions.for_model(kv_model, **options)
    except ConfigError:
        raise ConfigError(
            f"no known KV size for {kv_model!r}: give --kv-model (e.g. llama-3.1-8b, "
            "qwen2.5-7b, deepseek-v3; see persisting plan --help) or --bytes-per-token"
        ) from None


@contextmanager
def _target(
    server: list[str] | None,
    name: str | None,
    storage_path: Path | None,
    model: str,
    settings: PersistingSettings,
    sizes: dict[str, int | None],
    durability: str | None,
) -> Iterator[tuple[Any, str, Any]]:
    """``(target, its name for reports, its tier-hit reader)``, closed afterwards."""
    from persisting.bench.targets import (
        client_tier_hits,
        open_local_target,
        open_server_target,
        store_tier_hits,
    )

    if server:
        client = open_server_target(server, model, settings, name)
        try:
            yield client, f"server {', '.join(server)}", client_tier_hits(client)
        finally:
            client.close()
        return
    with _storage_root(storage_path) as root:
        store = open_local_target(root, model, settings=settings, durability=durability, **sizes)
        try:
            label = f"local store at {root}" if storage_path else "local store"
            yield store, label, store_tier_hits(store)
        finally:
            store.close()


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
    from persisting.bench.plot import values_caption

    console.print(
        f"Replayed {report.requests:,} requests into {escape(report.model)} on "
        f"{escape(report.target)} in {report.wall_s:.2f} s ({report.requests_per_s:,.1f} req/s).",
        highlight=False,
    )
    summary = Table(title="Hits and bytes", title_justify="left")
    summary.add_column("Figure")
    summary.add_column("Value", justify="right")
    summary.add_row("values", escape(values_caption(result)))
    summary.add_row("token hit rate", f"{report.token_hit_rate:.1%}")
    summary.add_row("best achievable (cold, unbounded cache)", f"{report.best_token_hit_rate:.1%}")
    summary.add_row("hit tokens", f"{report.hit_tokens:,} of {report.tokens:,}")
    summary.add_row("chunk hit rate", f"{report.chunk_hit_rate:.1%}")
    if report.memory_hit_chunks is not None:
        summary.add_row("hit chunks from memory", f"{report.memory_hit_chunks:,}")
        summary.add_row("hit chunks from disk", f"{report.disk_hit_chunks:,}")
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
        console.print(f"Plot written to {escape(str(plot))}", highlight=False)
