"""``persisting plan``: the capacity and bandwidth budget of a KV tier, as tables or JSON.

The flags are the fields of :class:`~persisting.planner.PlanInputs` one for one, so the
command hands its parameters over whole and an error names the flag that caused it. With
``--trace`` it plans from a workload's own requests instead: the token hit ratio against
capacity for the store's eviction policy, LRU and the offline optimum, and the TTFT those
hits save (:mod:`persisting.bench.curve`, worked out in blocks: nothing is allocated).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from persisting.bench.mooncake import MOONCAKE_BLOCK_TOKENS
from persisting.cli.app import JsonFlag, app, command
from persisting.cli.checks import module_for, output_file
from persisting.cli.output import emit, human_bytes, human_rate, progress_bar
from persisting.errors import ConfigError

if TYPE_CHECKING:
    from persisting.bench.curve import CurvePoint, TierBlocks
    from persisting.bench.mooncake import BlockTrace
    from persisting.planner import CapacityPlan, ModelShape, PlanLine
    from persisting.planner.ttft import TtftModel

MODEL_PANEL = "Model (a --model preset, its shape, or --bytes-per-token)"
WORKLOAD_PANEL = "Workload"
TRACE_PANEL = "Workload from a trace (instead of --prefix-tokens, --prefixes, --rps)"
HARDWARE_PANEL = "Hardware, per node (optional)"
RECOMPUTE_PANEL = "Load or recompute (optional)"


def _option(panel: str, help: str, *names: str, **kwargs: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, **kwargs)


@command(app, "plan", rich_help_panel="Planning")
def plan(
    ctx: typer.Context,
    prefix_tokens: Annotated[
        int | None, _option(WORKLOAD_PANEL, "Tokens in one shared prefix.")
    ] = None,
    prefixes: Annotated[
        int | None, _option(WORKLOAD_PANEL, "Distinct prefixes the tier keeps.")
    ] = None,
    rps: Annotated[
        float | None,
        _option(WORKLOAD_PANEL, "Requests/s; each reads its whole prefix from the tier."),
    ] = None,
    trace: Annotated[
        Path | None,
        _option(
            TRACE_PANEL,
            "A trace of your requests (Mooncake's format, or 'bench generate''s): plan the "
            "hit ratio against capacity from it.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    trace_format: Annotated[
        str, _option(TRACE_PANEL, "The trace's format: auto, mooncake or persisting.", "--format")
    ] = "auto",
    block_tokens: Annotated[
        int, _option(TRACE_PANEL, "Tokens per block of a Mooncake trace.")
    ] = MOONCAKE_BLOCK_TOKENS,
    capacities: Annotated[
        str | None,
        _option(
            TRACE_PANEL,
            "Capacities to plan, in blocks, comma-separated (default: 8 from 1% to all of the "
            "trace's distinct blocks); --memory-bytes and --disk-bytes are added.",
        ),
    ] = None,
    eviction: Annotated[
        str, _option(TRACE_PANEL, "The store's eviction policy to plan: value, lru or prefix.")
    ] = "value",
    plot: Annotated[
        Path | None, _option(TRACE_PANEL, "Write the hit ratio against capacity as a PNG.")
    ] = None,
    model: Annotated[
        str | None,
        _option(
            MODEL_PANEL,
            "A model by name: llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, qwen2.5-32b, "
            "qwen2.5-72b, deepseek-v3, mixtral-8x7b, mixtral-8x22b (or its Hugging Face id).",
        ),
    ] = None,
    layers: Annotated[int | None, _option(MODEL_PANEL, "Transformer layers.")] = None,
    kv_heads: Annotated[int | None, _option(MODEL_PANEL, "KV heads (GQA groups).")] = None,
    head_dim: Annotated[
        int | None, _option(MODEL_PANEL, "Dimension of one head (MLA: the latent width).")
    ] = None,
    dtype: Annotated[
        str | None, _option(MODEL_PANEL, "KV cache dtype: bf16, fp16, fp8, fp32 (default bf16).")
    ] = None,
    mla: Annotated[
        bool | None,
        _option(
            MODEL_PANEL,
            "An MLA latent cache (stored once: not K and V, not split by TP), or --no-mla.",
            "--mla/--no-mla",
        ),
    ] = None,
    bytes_per_token: Annotated[
        int | None, _option(MODEL_PANEL, "KV bytes per token, instead of the shape.")
    ] = None,
    chunk_size: Annotated[int, _option(WORKLOAD_PANEL, "Tokens per stored chunk.")] = 256,
    tp: Annotated[
        int, _option(WORKLOAD_PANEL, "Tensor-parallel ranks; each saves its share of a chunk.")
    ] = 1,
    replicas: Annotated[
        int,
        _option(
            WORKLOAD_PANEL,
            "What-if: copies of every object in a replicated deployment (Persisting keeps one).",
        ),
    ] = 1,
    fill: Annotated[
        float, _option(WORKLOAD_PANEL, "Share of a pool or disk data may fill, in (0, 1].")
    ] = 0.7,
    new_prefix_fraction: Annotated[
        float, _option(WORKLOAD_PANEL, "Share of requests that write a new prefix, in [0, 1].")
    ] = 0.0,
    new_prefix_tokens: Annotated[
        int | None,
        _option(WORKLOAD_PANEL, "Tokens in a newly written prefix (default: --prefix-tokens)."),
    ] = None,
    staging_ms: Annotated[
        float, _option(WORKLOAD_PANEL, "Average time data stays in staging buffers (ms).")
    ] = 100.0,
    nic_gbps: Annotated[float, _option(HARDWARE_PANEL, "NIC line rate in Gbit/s.")] = 200.0,
    nic_efficiency: Annotated[
        float, _option(HARDWARE_PANEL, "Share of line rate usable in practice, in (0, 1].")
    ] = 0.7,
    nodes: Annotated[int, _option(HARDWARE_PANEL, "Storage nodes sharing the prefixes.")] = 1,
    disk_bytes: Annotated[
        str | None, _option(HARDWARE_PANEL, "Disk for the disk tier, e.g. 3.84TB or 3.5TiB.")
    ] = None,
    memory_bytes: Annotated[
        str | None, _option(HARDWARE_PANEL, "Memory for the memory tier, e.g. 512GiB.")
    ] = None,
    disk_read: Annotated[
        str | None, _option(HARDWARE_PANEL, "Disk read bandwidth, e.g. 7GB/s.")
    ] = None,
    disk_write: Annotated[
        str | None, _option(HARDWARE_PANEL, "Disk write bandwidth, e.g. 3GB/s.")
    ] = None,
    network_read: Annotated[
        str | None,
        _option(
            RECOMPUTE_PANEL,
            "Read bandwidth a client on another host achieved, e.g. 1.1GB/s "
            "(benchmarks/remote_bench.py); default: the usable NIC bandwidth.",
        ),
    ] = None,
    gpu: Annotated[
        str | None,
        _option(
            RECOMPUTE_PANEL,
            "Estimate the prefill rate of --model on --tp of these GPUs: a100, l40s, h100, "
            "h200, mi300x, b200.",
        ),
    ] = None,
    prefill_tokens_per_s: Annotated[
        float | None, _option(RECOMPUTE_PANEL, "Prefill rate measured on your engine.")
    ] = None,
    mfu: Annotated[
        float, _option(RECOMPUTE_PANEL, "Share of the GPU peak a prefill reaches (--gpu).")
    ] = 0.5,
    json_out: JsonFlag = False,
) -> None:
    """Capacity, bandwidth and settings for a KV tier, exact to the byte (docs/capacity.md).

    Give the model (a preset, its shape or its bytes per token) and the workload; add the
    hardware to get kv.disk_bytes and kv.memory_bytes and what a box carries, and a GPU or
    a prefill rate to learn when a disk hit beats recomputing.
    """
    from persisting.planner import PlanInputs, plan_capacity

    trace_flags = ("trace", "trace_format", "block_tokens", "capacities", "eviction", "plot")
    fields = {k: v for k, v in ctx.params.items() if k != "json_out" and k not in trace_flags}
    if trace is not None:
        plan_trace(
            trace,
            fields,
            trace_format=trace_format,
            block_tokens=block_tokens,
            capacities=capacities,
            eviction=eviction,
            plot=plot,
            json_out=json_out,
        )
        return
    workload = ("prefix_tokens", "prefixes", "rps")
    missing = [f"--{k.replace('_', '-')}" for k in workload if fields[k] is None]
    if missing:
        raise ConfigError(
            f"give the workload ({', '.join(missing)}), or a trace of it (--trace FILE)"
        )
    result = plan_capacity(PlanInputs(**fields))
    emit(result.to_dict(), json_out, lambda console: render_plan(console, result))


def plan_trace(
    path: Path,
    fields: dict[str, Any],
    *,
    trace_format: str,
    block_tokens: int,
    capacities: str | None,
    eviction: str,
    plot: Path | None,
    json_out: bool,
) -> None:
    """The hit ratio against capacity for the trace at ``path``; ``fields`` are the other
    flags (the model, TP, the budgets, the prefill rate and read bandwidth)."""
    from persisting.bench.curve import blocks_in, default_capacities, hit_curve
    from persisting.kv.eviction.policy import eviction_policy

    if plot is not None:
        output_file(plot, "--plot")
        module_for("--plot", "matplotlib", "pip install matplotlib")
    eviction_policy(eviction)  # an unknown name is refused before the work
    blocks = _trace_blocks(path, trace_format, block_tokens, fields["chunk_size"])
    requests = [r.blocks for r in blocks.requests]
    shape, ttft = _trace_model(blocks, fields)
    object_bytes = (
        blocks.block_tokens * shape.stored_bytes_per_token // shape.objects_per_chunk
        if shape is not None
        else 0
    )
    budgets: TierBlocks | None = None
    chosen = _capacity_list(capacities) or default_capacities(requests)
    if shape is not None and (fields["memory_bytes"] or fields["disk_bytes"]):
        from persisting.planner.inputs import size

        memory = size(fields["memory_bytes"], "memory_bytes") if fields["memory_bytes"] else 0
        disk = size(fields["disk_bytes"], "disk_bytes") if fields["disk_bytes"] else 0
        budgets = blocks_in(memory, disk, object_bytes, shape.objects_per_chunk)
        chosen = sorted({*chosen, *(b for b in (budgets.memory, budgets.disk) if b > 0)})
    elif fields["memory_bytes"] or fields["disk_bytes"]:
        raise ConfigError("--memory-bytes and --disk-bytes need the model (--model, ...)")
    block_bytes = object_bytes * (shape.objects_per_chunk if shape is not None else 0)
    with progress_bar("planning", 3 * len(chosen)) as advance:
        points = hit_curve(
            requests,
            chosen,
            eviction=eviction,
            block_bytes=block_bytes,
            block_tokens=blocks.block_tokens,
            ttft=ttft,
            on_point=advance,
        )
    if plot is not None:
        from persisting.bench.plot import write_curve_plot

        write_curve_plot(points, plot, eviction=eviction, budgets=budgets, title=path.name)
    data = {
        "trace": str(path),
        "requests": len(blocks.requests),
        "block_references": blocks.references,
        "distinct_blocks": len({b for r in requests for b in r}),
        "block_tokens": blocks.block_tokens,
        "block_bytes": block_bytes or None,
        "eviction": eviction,
        "budget_blocks": (
            {"memory": budgets.memory, "disk": budgets.disk} if budgets is not None else None
        ),
        "ttft": ttft.to_dict() if ttft is not None else None,
        "points": [p.to_dict() for p in points],
        "plot": plot,
    }
    emit(data, json_out, lambda console: render_trace_plan(console, data, points, budgets))


def _trace_blocks(path: Path, trace_format: str, block_tokens: int, chunk_size: int) -> BlockTrace:
    from persisting.bench.compare import token_blocks
    from persisting.bench.mooncake import read_mooncake
    from persisting.bench.mooncake import trace_format as detect
    from persisting.bench.trace import read_trace

    if trace_format not in ("auto", "persisting", "mooncake"):
        raise ConfigError(f"--format must be auto, persisting or mooncake, got {trace_format!r}")
    fmt = detect(path) if trace_format == "auto" else trace_format
    if fmt == "mooncake":
        return read_mooncake(path, block_tokens)
    return token_blocks(read_trace(path), chunk_size)


def _trace_model(
    blocks: BlockTrace, fields: dict[str, Any]
) -> tuple[ModelShape | None, TtftModel | None]:
    """The model's shape (None when none was given) and the TTFT prices for the trace's
    mean prompt (None without a prefill rate)."""
    from persisting.planner import PlanInputs, plan_capacity

    model_flags = ("model", "layers", "kv_heads", "head_dim", "bytes_per_token")
    if not any(fields[k] is not None for k in model_flags):
        if fields["gpu"] is not None or fields["prefill_tokens_per_s"] is not None:
            raise ConfigError("a TTFT needs the model's KV size: give --model (or its shape)")
        return None, None
    prompt = max(1, blocks.references * blocks.block_tokens // max(1, len(blocks.requests)))
    inputs = {
        **{k: v for k, v in fields.items() if v is not None},
        "prefix_tokens": prompt,
        "prefixes": 1,
        "rps": 1,
    }
    from persisting.planner.ttft import ttft_of

    result = plan_capacity(PlanInputs(**inputs))
    return result.model, ttft_of(result)


def _capacity_list(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(
            f"--capacities must be block counts like 1000,3000, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"--capacities must be block counts >= 1, got {text!r}")
    return sorted(set(values))


def render_trace_plan(
    console: Console,
    data: dict[str, Any],
    points: list[CurvePoint],
    budgets: TierBlocks | None,
) -> None:
    """The curve as a table: per capacity, each policy's hit ratio and TTFT saving."""
    eviction = data["eviction"]
    console.print(
        f"[bold]Trace:[/] {escape(data['trace'])}: {data['requests']:,} requests, "
        f"{data['block_references']:,} block references, {data['distinct_blocks']:,} distinct "
        f"blocks of {data['block_tokens']} tokens"
        + (f" ({human_bytes(data['block_bytes'])} each)" if data["block_bytes"] else "")
        + ".",
        highlight=False,
    )
    table = Table(title="Token hit ratio against capacity", title_justify="left")
    table.add_column("Capacity (blocks)", justify="right")
    if data["block_bytes"]:
        table.add_column("Bytes", justify="right")
    for name in (eviction, "LRU", "MIN (offline)"):
        table.add_column(escape(name), justify="right")
    table.add_column(f"{escape(eviction)} / LRU", justify="right")
    if data["ttft"]:
        table.add_column(f"TTFT saved per request ({escape(eviction)})", justify="right")
    marks = {}
    if budgets is not None:
        marks = {budgets.memory: "memory budget", budgets.disk: "disk budget"}
    for point in points:
        rates = point.policies
        row = [
            f"{point.capacity_blocks:,}"
            + (f" ({marks[point.capacity_blocks]})" if point.capacity_blocks in marks else "")
        ]
        if data["block_bytes"]:
            row.append(human_bytes(point.capacity_bytes))
        row += [f"{rates[eviction]:.1%}", f"{rates['lru']:.1%}", f"{rates['min']:.1%}"]
        row.append(f"{rates[eviction] / rates['lru']:.2f}x" if rates["lru"] else "n/a")
        if data["ttft"]:
            row.append(f"{point.ttft_saving_ms[eviction]:,.1f} ms")
        table.add_row(*row)
    console.print(table)
    if data["ttft"]:
        t = data["ttft"]
        console.print(
            f"A hit token saves {t['saving_ms_per_hit_token'] * 1000:,.2f} us of TTFT "
            f"(prefill {t['prefill_tokens_per_s']:,} tokens/s"
            + (" estimated" if t["estimated"] else "")
            + (
                f", loads at {human_rate(t['read_bytes_per_s'])}"
                if t["read_bytes_per_s"]
                else ", loads taken as free"
            )
            + ").",
            highlight=False,
        )
    if data["plot"] is not None:
        console.print(f"Plot written to {escape(str(data['plot']))}", highlight=False)


def render_plan(console: Console, result: CapacityPlan) -> None:
    """The plan as tables: figure, human value, exact value, how it is worked out."""
    from persisting.planner import HARDWARE_LINES, PLAN_LINES, RECOMPUTE_LINES

    i, m = result.inputs, result.model
    console.print(f"[bold]Model:[/] {escape(describe_model(result))}", highlight=False)
    console.print(
        f"[bold]Workload:[/] {i.prefixes:,} prefixes of {i.prefix_tokens:,} tokens, chunk "
        f"{i.chunk_size}, TP {i.tp}, {i.replicas} replica(s), fill {float(i.fill):g}, "
        f"{float(i.rps):g} req/s, {float(i.new_prefix_fraction):g} of them writing "
        f"{i.new_prefix_tokens:,}-token prefixes, staging {float(i.staging_ms):g} ms, NIC "
        f"{float(i.nic_gbps):g} Gbps at {float(i.nic_efficiency):g}.",
        highlight=False,
    )
    meanings = {}
    if m.attention == "given":
        meanings["bytes_per_token"] = "given directly (--bytes-per-token)"
    _table(console, "Capacity and bandwidth budget", PLAN_LINES, result, meanings)
    _headroom(console, result.nic_headroom, "NIC", "Reads alone exceed the usable NIC bandwidth")
    if result.hardware is not None:
        hw = result.hardware
        _table(console, f"Hardware ({hw.nodes} node(s))", HARDWARE_LINES, hw, {})
        _headroom(console, hw.disk_read_headroom, "disk", "Disk reads exceed the disk bandwidth")
        _headroom(console, hw.disk_write_headroom, "disk", "Disk writes exceed the disk bandwidth")
        if hw.fits_on_disk is False:
            console.print(
                "[bold red]The prefixes do not fit on disk:[/] the disk tier will evict, "
                f"and holds {hw.prefixes_on_disk:,} of {i.prefixes:,}."
            )
        settings = [
            f"{name} = {setting_text(value)}"
            for name, value in (
                ("disk_bytes", hw.kv_disk_bytes),
                ("memory_bytes", hw.kv_memory_bytes),
            )
            if value is not None
        ]
        toml = escape("\n".join(["[kv]", *settings]))
        console.print(f"[bold]Settings for persisting.toml:[/]\n{toml}", highlight=False)
    if result.recompute is not None:
        _table(console, "Load or recompute (per engine)", RECOMPUTE_LINES, result.recompute, {})
    for warning in result.warnings:
        console.print(f"[bold yellow]Warning:[/] {escape(warning)}", highlight=False)
    for note in result.notes:
        console.print(f"[dim]Note: {escape(note)}[/]", highlight=False)


def describe_model(result: CapacityPlan) -> str:
    m = result.model
    per_token = f"{human_bytes(m.stored_bytes_per_token)} per token"
    layout = f"{m.objects_per_chunk} object(s) per chunk"
    if m.attention == "given":
        return f"{m.bytes_per_token:,} bytes per token (given), {layout}"
    name = f"{m.name} ({m.hf_id}): " if m.name else ""
    if m.attention == "mla":
        shape = f"{m.layers} layers x MLA latent {m.head_dim}, {m.dtype}"
    else:
        shape = f"{m.layers} layers x {m.kv_heads} KV heads x head dim {m.head_dim}, {m.dtype}"
    return f"{name}{shape}: {per_token}, {layout}"


def setting_text(value: int) -> str:
    """A size as a TOML string in the largest binary unit that divides it."""
    from persisting.config import size_text

    return f'"{size_text(value)}"'


def _table(
    console: Console, title: str, lines: tuple[PlanLine, ...], source: Any, meanings: dict[str, str]
) -> None:
    table = Table(title=title, title_justify="left")
    table.add_column("Figure (--json name)", no_wrap=True)
    table.add_column("Value (exact below)", justify="right", no_wrap=True)
    table.add_column("How it is worked out")
    for line in lines:
        value = getattr(source, line.name)
        if value is None and line.unit != "ratio":
            continue
        table.add_row(
            line.name, plan_value(value, line.unit), meanings.get(line.name, line.meaning)
        )
    console.print(table)


def _headroom(console: Console, headroom: float | None, what: str, alarm: str) -> None:
    if headroom is None:
        return
    if headroom < 1:
        console.print(f"[bold red]{alarm}.[/]")
    elif headroom < 1.5:
        console.print(
            f"[yellow]Under 1.5x {what} headroom: little room for bursts, failures and "
            "re-replication.[/]"
        )


def plan_value(value: Any, unit: str) -> str:
    """A human value, with the exact figure on a dim second line where they differ."""
    if value is None:
        return "n/a"
    if unit == "text":
        return str(value)
    if unit == "ratio":
        return f"{value:.2f}x"
    if unit == "share":
        return f"{value:.1%}"
    if unit == "ms":
        return f"{value:,.1f} ms"
    if unit == "count":
        return f"{value:,}"
    if unit == "count/s":
        return f"{value:,.1f} /s" if isinstance(value, float) else f"{value:,} /s"
    human = human_bytes(value) if unit == "bytes" else human_rate(value)
    if value < 1024:
        return human
    return f"{human}\n[dim]{value:,} B{'/s' if unit == 'bytes/s' else ''}[/]"


__all__ = ["describe_model", "plan_value", "render_plan"]
