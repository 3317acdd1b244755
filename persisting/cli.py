"""The ``persisting`` command line: the top of the house (it may import everything)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Persisting: a tiered KV-cache store and a durable Lance queue.")


@app.callback()
def _root() -> None:
    """Persisting command line."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
