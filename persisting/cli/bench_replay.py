"""The work of ``persisting bench replay``: reading a trace into blocks, replaying it through
a store (or working it out in blocks when its budgets exceed this machine), the references
and TTFT beside the store's figures, and the tables that show them."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from persisting.cli.app import fail
from persisting.cli.output import emit, human_bytes, human_ms, human_rate, progress_bar
from persisting.errors import ConfigError

if TYPE_CHECKING:
    from persisting.bench.curve import TierBlocks
    from persisting.bench.mooncake import BlockTrace
    from persisting.bench.replay import ReplayOptions, ReplayResult
    from persisting.bench.report import ReplayReport
    from persisting.bench.trace import Trace
    from persisting.config import KVSettings, PersistingSettings
    from persisting.planner.ttft import TtftModel


BLOCK_TRACE_BYTES_PER_TOKEN = 4
BLOCK_TRACE_MODEL = "mooncake/trace"


@dataclass
class ReplayInput:
    """A trace ready to replay: its blocks (and its token form, if it has one)."""

    fmt: str
    model: str
    options: ReplayOptions
    blocks: BlockTrace
    tokens: Trace | None


def replay_input(
    path: Path,
    trace_format: str,
    *,
    block_tokens: int,
    chunk_size: int,
    model: str | None,
    kv_model: str | None,
    bytes_per_token: int | None,
    layers: int | None,
    tp: int,
    realtime: bool,
    verify: bool,
) -> ReplayInput:
    from persisting.bench.compare import token_blocks
    from persisting.bench.mooncake import read_mooncake
    from persisting.bench.mooncake import trace_format as detect
    from persisting.bench.trace import read_trace

    if trace_format not in ("auto", "persisting", "mooncake"):
        raise ConfigError(f"--format must be auto, persisting or mooncake, got {trace_format!r}")
    fmt = detect(path) if trace_format == "auto" else trace_format
    if fmt == "mooncake":
        blocks = read_mooncake(path, block_tokens)
        name = model or BLOCK_TRACE_MODEL
        options = value_options(
            kv_model,
            bytes_per_token or (None if kv_model else BLOCK_TRACE_BYTES_PER_TOKEN),
            layers,
            chunk_size=block_tokens,
            realtime=realtime,
            verify=verify,
            tp=tp,
        )
        return ReplayInput(fmt, name, options, blocks, None)
    trace = read_trace(path)
    if model:
        trace = replace(trace, header=replace(trace.header, model=model))
    options = value_options(
        kv_model or (None if bytes_per_token else trace.header.model),
        bytes_per_token,
        layers,
        chunk_size=chunk_size,
        realtime=realtime,
        verify=verify,
        tp=tp,
    )
    return ReplayInput(fmt, trace.header.model, options, token_blocks(trace, chunk_size), trace)


def shortfall_of(replay_in: ReplayInput, kv: KVSettings, root: Path | None) -> str | None:
    """Why this replay cannot run through a real store here (None when it can): the
    memory budget is mapped whole, the disk holds at most the trace's distinct blocks."""
    from persisting.bench.compare import machine_shortfall
    from persisting.kv.disk.payload_files import file_size

    options = replay_in.options
    blocks = replay_in.blocks.distinct_blocks()
    on_disk = blocks * options.tp * file_size(options.object_bytes)
    return machine_shortfall(kv.memory_bytes, min(kv.disk_bytes, on_disk), root)


def ttft_prices(
    replay_in: ReplayInput,
    prefill_tokens_per_s: float | None,
    gpu: str | None,
    read_bandwidth: str | None,
) -> TtftModel | None:
    """The planner's TTFT prices for this trace's mean prompt, when a prefill rate is had."""
    from persisting.planner.ttft import ttft_model

    if prefill_tokens_per_s is None and gpu is None:
        if read_bandwidth is not None:
            raise ConfigError(
                "--read-bandwidth prices a TTFT: give --prefill-tokens-per-s or --gpu"
            )
        return None
    options = replay_in.options
    requests = replay_in.blocks.requests
    prompt = replay_in.blocks.references * options.chunk_size // max(1, len(requests))
    model_inputs: dict[str, Any] = (
        {"model": options.kv_model}
        if options.kv_model
        else {"bytes_per_token": options.bytes_per_token, "mla": False}
    )
    return ttft_model(
        prompt,
        **model_inputs,
        tp=options.tp,
        gpu=gpu,
        prefill_tokens_per_s=prefill_tokens_per_s,
        disk_read=read_bandwidth,
    )


def tier_blocks(replay_in: ReplayInput, memory_bytes: int, disk_bytes: int) -> TierBlocks:
    from persisting.bench.curve import blocks_in

    options = replay_in.options
    return blocks_in(memory_bytes, disk_bytes, options.object_bytes, options.tp)


def run_simulated(
    replay_in: ReplayInput,
    kv: KVSettings,
    shortfall: str | None,
    ttft_in: TtftModel | None,
    json_out: bool,
) -> None:
    from persisting.bench.compare import references, simulated_replay, ttft

    tiers = tier_blocks(replay_in, kv.memory_bytes, kv.disk_bytes)
    blocks = replay_in.blocks
    with progress_bar("simulating", len(blocks.requests)) as advance:
        sim = simulated_replay(blocks, tiers, kv.eviction, on_request=advance)
    refs = references([r.blocks for r in blocks.requests], tiers)
    data: dict[str, Any] = {
        **_setup(replay_in, kv),
        "simulated": True,
        "why_simulated": shortfall or "--simulate",
        **sim.to_dict(),
        **refs.to_dict(),
        "ttft": ttft(ttft_in, sim.records).to_dict() if ttft_in is not None else None,
    }

    def render(console: Console) -> None:
        console.print(
            f"Simulated {sim.requests:,} requests in blocks, nothing stored "
            f"({escape(shortfall or 'as asked')}).",
            highlight=False,
        )
        _render_comparison(console, data)

    emit(data, json_out, render)


def run_replayed(
    replay_in: ReplayInput,
    kv: KVSettings,
    settings: PersistingSettings,
    server: list[str] | None,
    name: str | None,
    storage_path: Path | None,
    ttft_in: TtftModel | None,
    plot: Path | None,
    json_out: bool,
) -> None:
    from persisting.bench.compare import references, ttft
    from persisting.bench.replay import replay, replay_blocks
    from persisting.bench.report import summarize

    settings = settings.model_copy(update={"kv": kv})
    options = replay_in.options
    figures: dict[str, Any] = {}
    opened = _target(server, name, storage_path, replay_in.model, settings)
    with (
        opened as (target, label, tier_hits, store_figures),
        progress_bar("replaying", len(replay_in.blocks.requests)) as advance,
    ):
        if replay_in.tokens is not None and options.tp == 1:
            result = replay(
                replay_in.tokens,
                target,
                options,
                target_name=label,
                on_request=lambda _record: advance(),
                tier_hits=tier_hits,
            )
        else:
            result = replay_blocks(
                replay_in.blocks,
                target,
                options,
                model=replay_in.model,
                target_name=label,
                on_request=lambda _record: advance(),
                tier_hits=tier_hits,
            )
        figures = store_figures()
    report = summarize(result)
    if plot is not None:
        from persisting.bench.plot import write_plot

        write_plot(result, plot)
    data: dict[str, Any] = {**_setup(replay_in, kv), "simulated": False, **report.to_dict()}
    if figures:
        tiers = tier_blocks(
            replay_in, int(figures.get("memory_capacity", 0)), int(figures.get("disk_capacity", 0))
        )
        data.update(references([r.blocks for r in result.records], tiers).to_dict())
        written = int(figures.get("disk_written_bytes", 0))
        data["disk_bytes_written"] = written
        data["disk_bytes_written_per_hit_token"] = (
            written / report.hit_tokens if report.hit_tokens else None
        )
    data["ttft"] = ttft(ttft_in, result.records).to_dict() if ttft_in is not None else None
    data["plot"] = plot
    emit(
        data,
        json_out,
        lambda console: render_replay(console, report, result, plot, data),
    )
    if report.mismatches:
        fail(f"{report.mismatches} loaded chunk(s) did not match what was stored")


def _setup(replay_in: ReplayInput, kv: KVSettings) -> dict[str, Any]:
    """What was replayed, on what: the JSON's first keys."""
    options = replay_in.options
    return {
        "format": replay_in.fmt,
        "block_tokens": options.chunk_size,
        "tp": options.tp,
        "object_bytes": options.object_bytes,
        "block_bytes": options.object_bytes * options.tp,
        "eviction": kv.eviction,
        "admission": kv.admission,
        "durability": kv.durability,
        "memory_budget_bytes": kv.memory_bytes,
        "disk_budget_bytes": kv.disk_bytes,
    }


def value_options(
    kv_model: str | None, bytes_per_token: int | None, layers: int | None, **options: Any
) -> ReplayOptions:
    """Replay options whose values weigh a model's KV (``--kv-model``), or a given size."""
    from persisting.bench.replay import ReplayOptions

    if bytes_per_token is not None:
        if kv_model is not None:
            raise ConfigError("give --kv-model or --bytes-per-token, not both")
        built = ReplayOptions(bytes_per_token=bytes_per_token, layers=layers or 1, **options)
        built.validate()
        return built
    if layers is not None:
        raise ConfigError("--layers goes with --bytes-per-token")
    assert kv_model is not None
    try:
        built = ReplayOptions.for_model(kv_model, **options)
    except ConfigError:
        raise ConfigError(
            f"no known KV size for {kv_model!r}: give --kv-model (e.g. llama-3.1-8b, "
            "qwen2.5-7b, deepseek-v3; see persisting plan --help) or --bytes-per-token"
        ) from None
    built.validate()
    return built


@contextmanager
def _target(
    server: list[str] | None,
    name: str | None,
    storage_path: Path | None,
    model: str,
    settings: PersistingSettings,
) -> Iterator[tuple[Any, str, Any, Callable[[], dict[str, Any]]]]:
    """``(target, its name for reports, its tier-hit reader, its store figures)``, closed
    afterwards (a server's figures are not read: ``{}``); the store's options come from
    ``settings.kv``."""
    from persisting.bench.targets import (
        client_tier_hits,
        open_local_target,
        open_server_target,
        store_tier_hits,
    )

    if server:
        client = open_server_target(server, model, settings, name)
        try:
            yield client, f"server {', '.join(server)}", client_tier_hits(client), dict
        finally:
            client.close()
        return
    with _storage_root(storage_path) as root:
        store = open_local_target(root, model, settings=settings)
        try:
            label = f"local store at {root}" if storage_path else "local store"
            yield store, label, store_tier_hits(store), store.stats
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
    console: Console,
    report: ReplayReport,
    result: ReplayResult,
    plot: Path | None,
    data: dict[str, Any] | None = None,
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
    if data and data.get("lru_token_hit_rate") is not None:
        _reference_rows(summary, data)
    summary.add_row("best achievable (cold, unbounded cache)", f"{report.best_token_hit_rate:.1%}")
    summary.add_row("hit tokens", f"{report.hit_tokens:,} of {report.tokens:,}")
    summary.add_row("chunk hit rate", f"{report.chunk_hit_rate:.1%}")
    if report.memory_hit_chunks is not None:
        summary.add_row("hit chunks from memory", f"{report.memory_hit_chunks:,}")
        summary.add_row("hit chunks from disk", f"{report.disk_hit_chunks:,}")
    summary.add_row("requests with a hit", f"{report.requests_with_hits:,}")
    summary.add_row("bytes read", human_bytes(report.bytes_read))
    summary.add_row("bytes written", human_bytes(report.bytes_written))
    if data and data.get("disk_bytes_written") is not None:
        summary.add_row("disk bytes written", human_bytes(data["disk_bytes_written"]))
        per_hit = data.get("disk_bytes_written_per_hit_token")
        summary.add_row("disk bytes written per hit token", f"{per_hit:,.0f}" if per_hit else "n/a")
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
    if data and data.get("ttft"):
        _render_ttft(console, data["ttft"])
    if plot is not None:
        console.print(f"Plot written to {escape(str(plot))}", highlight=False)


def _reference_rows(table: Table, data: dict[str, Any]) -> None:
    """The store's eviction and the references at its capacity, as rows of ``table``."""
    blocks = data["capacity_blocks"]
    table.add_row(
        "capacity in blocks (larger tier)",
        f"{blocks:,} (memory {data['memory_blocks']:,}, disk {data['disk_blocks']:,})",
    )
    table.add_row("LRU at that capacity", f"{data['lru_token_hit_rate']:.1%}")
    table.add_row("offline optimum (MIN) at it", f"{data['belady_token_hit_rate']:.1%}")
    lru = data["lru_token_hit_rate"]
    if lru:
        table.add_row(
            f"{escape(str(data['eviction']))} / LRU", f"{data['token_hit_rate'] / lru:.2f}x"
        )


def _render_comparison(console: Console, data: dict[str, Any]) -> None:
    table = Table(title="Hits (simulated in blocks)", title_justify="left")
    table.add_column("Figure")
    table.add_column("Value", justify="right")
    table.add_row(
        "block",
        f"{data['block_tokens']} tokens, {human_bytes(data['block_bytes'])} (TP {data['tp']})",
    )
    table.add_row(
        f"token hit rate ({escape(str(data['eviction']))})", f"{data['token_hit_rate']:.1%}"
    )
    table.add_row("of which the memory tier alone", f"{data['memory_token_hit_rate']:.1%}")
    _reference_rows(table, data)
    console.print(table)
    if data.get("ttft"):
        _render_ttft(console, data["ttft"])


def _render_ttft(console: Console, ttft: dict[str, Any]) -> None:
    estimated = " (estimated from the GPU's peak)" if ttft["estimated"] else ""
    loads = (
        f"loads at {human_rate(ttft['read_bytes_per_s'])}"
        if ttft["read_bytes_per_s"]
        else "loads taken as free"
    )
    console.print(
        f"TTFT, prefill-bound: {ttft['mean_ttft_ms_without_cache']:,.1f} ms per request "
        f"without the cache, {ttft['mean_ttft_ms']:,.1f} ms with its hits "
        f"({ttft['saving_ms_per_request']:,.1f} ms saved; "
        f"{ttft['saving_ms_per_hit_token'] * 1000:,.2f} us per hit token; prefill "
        f"{ttft['prefill_tokens_per_s']:,} tokens/s{estimated}, {loads}).",
        highlight=False,
    )
