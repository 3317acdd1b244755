"""``persisting bench generate | replay``: synthetic traces and replays against a store."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from persisting.cli.app import ConfigOption, JsonFlag, bench_app, command, fail, load_settings
from persisting.cli.output import emit, human_bytes, human_ms, human_rate, progress_bar

if TYPE_CHECKING:
    from persisting.bench.replay import ReplayResult
    from persisting.bench.report import ReplayReport


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
