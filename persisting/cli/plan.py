"""``persisting plan``: the capacity and bandwidth budget of a KV tier, as a table or JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from persisting.cli.app import JsonFlag, app, command
from persisting.cli.output import emit, human_bytes, human_rate

if TYPE_CHECKING:
    from persisting.planner import CapacityPlan


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
