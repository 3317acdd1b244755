"""How commands show results: the same data as ``--json`` or as rich tables, in human units.

Everything a command prints goes through :func:`emit`, so a script reading ``--json`` and
a person reading the table see the same figures. Units are binary for sizes (``768 MiB``)
and also decimal for rates (``17.50 GB/s``), because NIC and disk specs are decimal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def stdout() -> Console:
    """A console on the current stdout (made per call so test runners can capture it)."""
    return Console()


def stderr() -> Console:
    return Console(stderr=True)


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
    """Milliseconds to three significant digits (``0.000312``, ``0.0375``, ``40.8``,
    ``1,577``): a fixed number of decimals shows a sub-microsecond mean as ``0.000``."""
    if ms is None:
        return "-"
    if ms == 0 or not math.isfinite(ms):
        return f"{ms:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(ms))))
    return f"{ms:,.{decimals}f}"


def count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


__all__ = [
    "count",
    "emit",
    "human_bytes",
    "human_ms",
    "human_rate",
    "progress_bar",
    "stderr",
    "stdout",
    "to_jsonable",
]
