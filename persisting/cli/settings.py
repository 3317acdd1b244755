"""``persisting config sample | show``: every setting with its default, and the settings in
effect (what a server started here would use)."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from persisting.cli.app import ConfigOption, JsonFlag, app, command, load_settings
from persisting.cli.config_sample import is_size
from persisting.cli.output import emit
from persisting.config import PersistingSettings, setting_fields, size_text

config_app = typer.Typer(
    help="Settings: a sample file with every default, and the settings in effect.",
    no_args_is_help=True,
)
app.add_typer(config_app, name="config", rich_help_panel="Settings")

#: Shown instead of a secret's value.
HIDDEN = "<hidden>"


@command(config_app, "sample")
def sample() -> None:
    """Print a persisting.toml with every setting at its default, each explained."""
    from persisting.cli.config_sample import sample_toml

    typer.echo(sample_toml(), nl=False)


@command(config_app, "show")
def show(config: ConfigOption = None, json_out: JsonFlag = False) -> None:
    """The settings in effect: TOML (--config or PERSISTING_CONFIG), PERSISTING_* variables
    and defaults merged, after validation (an invalid setting is an error)."""
    settings = load_settings(config)
    data: dict[str, Any] = settings.model_dump(mode="json")
    if data["service"].get("passphrase"):
        data["service"]["passphrase"] = HIDDEN

    def render(console: Console) -> None:
        for key, value in data.items():
            if isinstance(value, dict):
                console.print(f"[bold]\\[{key}][/]")
                section = setting_fields(PersistingSettings).get(key)
                for sub, item in value.items():
                    shown = _shown(item, section is not None and is_size(section, sub))
                    console.print(f"  {sub} = {escape(shown)}", highlight=False)
            else:
                console.print(f"{key} = {escape(repr(value))}", highlight=False)

    emit(data, json_out, render)


def _shown(value: Any, size: bool) -> str:
    """A setting as ``show`` prints it: a size with its unit (``2GiB``, ``512MiB``, or
    ``1000B`` when no binary unit divides it), anything else as Python writes it."""
    if size and isinstance(value, int) and not isinstance(value, bool):
        return size_text(value)
    return repr(value)


__all__ = ["config_app"]
