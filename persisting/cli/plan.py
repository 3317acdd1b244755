"""``persisting plan``: the capacity and bandwidth budget of a KV tier, as tables or JSON.

The flags are the fields of :class:`~persisting.planner.PlanInputs` one for one, so the
command hands its parameters over whole and an error names the flag that caused it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from persisting.cli.app import JsonFlag, app, command
from persisting.cli.output import emit, human_bytes, human_rate

if TYPE_CHECKING:
    from persisting.planner import CapacityPlan, PlanLine

MODEL_PANEL = "Model (a --model preset, its shape, or --bytes-per-token)"
WORKLOAD_PANEL = "Workload"
HARDWARE_PANEL = "Hardware, per node (optional)"
RECOMPUTE_PANEL = "Load or recompute (optional)"


def _option(panel: str, help: str, *names: str, **kwargs: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, **kwargs)


@command(app, "plan", rich_help_panel="Planning")
def plan(
    ctx: typer.Context,
    prefix_tokens: Annotated[int, _option(WORKLOAD_PANEL, "Tokens in one shared prefix.")],
    prefixes: Annotated[int, _option(WORKLOAD_PANEL, "Distinct prefixes the tier keeps.")],
    rps: Annotated[
        float, _option(WORKLOAD_PANEL, "Requests/s; each reads its whole prefix from the tier.")
    ],
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

    fields = {k: v for k, v in ctx.params.items() if k != "json_out"}
    result = plan_capacity(PlanInputs(**fields))
    emit(result.to_dict(), json_out, lambda console: render_plan(console, result))


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
