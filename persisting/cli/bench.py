"""``persisting bench generate | replay``: synthetic traces, replayed against a local store
or a running server, with values the size of a real model's KV."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from persisting.bench.mooncake import MOONCAKE_BLOCK_TOKENS
from persisting.cli.app import ConfigOption, JsonFlag, bench_app, command, load_settings
from persisting.cli.bench_pool import check_pool, run_pool
from persisting.cli.bench_replay import (
    BLOCK_TRACE_BYTES_PER_TOKEN,
    replay_input,
    run_replayed,
    run_simulated,
    shortfall_of,
    ttft_prices,
)
from persisting.cli.checks import module_for, output_file, storage_folder
from persisting.cli.output import emit
from persisting.config import parse_bytes, socket_address
from persisting.errors import ConfigError

if TYPE_CHECKING:
    pass

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
    trace_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="Trace format: persisting (token traces, 'bench generate'), mooncake "
            "(Mooncake's block traces: block i of a record is hash_ids[i]) or auto.",
        ),
    ] = "auto",
    block_tokens: Annotated[
        int,
        typer.Option(help="Tokens per block of a mooncake trace (the chunk size follows)."),
    ] = MOONCAKE_BLOCK_TOKENS,
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
        str | None,
        typer.Option(help="Model namespace (default: the trace's; mooncake: mooncake/trace)."),
    ] = None,
    kv_model: Annotated[
        str | None,
        typer.Option(
            help="Model whose KV size the values take, e.g. llama-3.1-8b (default: the "
            "trace's model when it is a known one)."
        ),
    ] = None,
    bytes_per_token: Annotated[
        int | None,
        typer.Option(
            help="KV bytes per token of the values, all ranks, instead of --kv-model "
            f"(mooncake traces: default {BLOCK_TRACE_BYTES_PER_TOKEN})."
        ),
    ] = None,
    layers: Annotated[
        int | None, typer.Option(help="Layers of the values (with --bytes-per-token).")
    ] = None,
    tp: Annotated[
        int,
        typer.Option(
            help="Tensor-parallel ranks: each block is stored as TP objects of 1/TP of its bytes."
        ),
    ] = 1,
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
    eviction: Annotated[
        str | None,
        typer.Option(help="Local eviction policy: value, lru or prefix (default: settings)."),
    ] = None,
    admission: Annotated[
        str | None,
        typer.Option(help="Local disk admission: always or second_sighting (default: settings)."),
    ] = None,
    chunk_size: Annotated[
        int | None, typer.Option(help="Tokens per chunk (default: settings).")
    ] = None,
    simulate: Annotated[
        bool,
        typer.Option(
            help="Work the hits out in blocks without storing a byte (also when the budgets "
            "exceed this machine)."
        ),
    ] = False,
    prefill_tokens_per_s: Annotated[
        float | None,
        typer.Option(help="Prefill rate measured on your engine, for the TTFT estimate."),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="Estimate the prefill rate of --kv-model on --tp of these GPUs."),
    ] = None,
    read_bandwidth: Annotated[
        str | None,
        typer.Option(help="Bandwidth a hit loads at, e.g. 7GB/s (default: loads are free)."),
    ] = None,
    realtime: Annotated[
        bool, typer.Option(help="Pace requests at trace times instead of back to back.")
    ] = False,
    verify: Annotated[bool, typer.Option(help="Check every loaded chunk's contents.")] = True,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write a PNG: latency CDF, hits by tier over time, best achievable."),
    ] = None,
    members: Annotated[
        int | None,
        typer.Option(
            help="Simulate a pool of this many storage members (with --member-blocks): the "
            "hit ratio whole and with one member lost, for one copy, two copies of "
            "everything and a second copy of reused blocks (docs/benchmarks.md)."
        ),
    ] = None,
    member_blocks: Annotated[
        int | None, typer.Option(help="Blocks each member of --members holds (LRU).")
    ] = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Replay a trace against a local store (or --server); report the token hit ratio beside
    LRU's and the offline optimum's at the same capacity, hits by tier, bytes, latency and,
    with a prefill rate, the TTFT the hits save (docs/capacity.md)."""
    if plot is not None:  # checked before the work, not after it
        output_file(plot, "--plot")
        module_for("--plot", "matplotlib", "pip install matplotlib")
    pool = check_pool(members, member_blocks)
    local_flags = {
        "--storage-path": storage_path,
        "--memory-bytes": memory_bytes,
        "--disk-bytes": disk_bytes,
        "--durability": durability,
        "--eviction": eviction,
        "--admission": admission,
        "--simulate": simulate or None,
    }
    if pool:
        _pool_alone(server, plot, local_flags)
    if server:
        for addr in server:
            socket_address(addr, "--server")
        given = [flag for flag, value in local_flags.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} set a local store: not with --server")
    elif storage_path is not None:
        storage_folder(storage_path)
    settings = load_settings(config)
    overrides = {
        "memory_bytes": _size(memory_bytes, "--memory-bytes"),
        "disk_bytes": _size(disk_bytes, "--disk-bytes"),
        "durability": durability,
        "eviction": eviction,
        "admission": admission,
    }
    kv = settings.kv.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    replay_in = replay_input(
        trace_file,
        trace_format,
        block_tokens=block_tokens,
        chunk_size=chunk_size or settings.kv.chunk_size,
        model=model,
        kv_model=kv_model,
        bytes_per_token=bytes_per_token,
        layers=layers,
        tp=tp,
        realtime=realtime,
        verify=verify,
    )
    if pool:
        assert members is not None and member_blocks is not None
        run_pool(replay_in, members, member_blocks, json_out)
        return
    ttft_in = ttft_prices(replay_in, prefill_tokens_per_s, gpu, read_bandwidth)
    shortfall = None if server else shortfall_of(replay_in, kv, storage_path)
    if simulate or shortfall:
        if plot is not None:
            raise ConfigError("--plot draws a replay's latencies: not with a simulated one")
        run_simulated(replay_in, kv, shortfall, ttft_in, json_out)
        return
    run_replayed(replay_in, kv, settings, server, name, storage_path, ttft_in, plot, json_out)


def _pool_alone(server: list[str] | None, plot: Path | None, local: Mapping[str, object]) -> None:
    """A pool is simulated in blocks: not with a server, a plot or a local store's flags."""
    given = [flag for flag, value in local.items() if value is not None]
    given += ["--server"] * bool(server) + ["--plot"] * (plot is not None)
    if given:
        raise ConfigError(f"{', '.join(given)}: not with --members (a pool simulated in blocks)")


def _size(value: str | None, flag: str) -> int | None:
    if value is None:
        return None
    try:
        return int(parse_bytes(value))
    except ValueError:
        raise ConfigError(f"{flag} must be a size such as 8GiB or 512MB, got {value!r}") from None
