"""The Typer application, its one-line errors, and the options several commands share.

Every way a command can fail on its input ends in one line on stderr and an exit code:
2 for bad input (a usage error, a :class:`ValueError`-kind :class:`PersistingError`), 1 for
any other failure Persisting knows about. Usage errors are shortened to one line by
:class:`OneLineErrors`, which is also what ``CliRunner`` exercises in tests.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.22 carries its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer on top of click
    from click import get_current_context  # type: ignore[no-redef]
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore

from persisting.cli.output import stderr
from persisting.errors import PersistingError

if TYPE_CHECKING:
    from persisting.config import PersistingSettings

#: Exit code of a command given impossible input (click's usage errors use it too).
EXIT_BAD_INPUT = 2
#: Exit code of a command that failed for any other reason Persisting knows about.
EXIT_FAILED = 1

F = TypeVar("F", bound=Callable[..., Any])


def one_line(message: str) -> str:
    """``message`` on one line: its lines joined with ``; `` (a multi-line error would be
    cut by log collectors and hard to grep)."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``Error: message`` on one line of stderr and exit with ``code``."""
    _print_error(message)
    raise typer.Exit(code)


class OneLineErrors(TyperGroup):
    """The top-level group: click's usage errors (a missing option, a value that does not
    parse) become one ``Error:`` line naming the flag, plus where to find help."""

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            result = super().main(args, prog_name, complete_var, False, **extra)
        except NoArgsIsHelpError as exc:  # the help is already printed
            sys.exit(exc.exit_code)
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else (prog_name or "persisting")
            _print_error(f"{exc.format_message()} (see '{where} --help')")
            sys.exit(exc.exit_code)
        except ClickException as exc:
            _print_error(exc.format_message())
            sys.exit(exc.exit_code)
        except typer.Abort:
            _print_error("aborted")
            sys.exit(EXIT_FAILED)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "pulsing":
                raise
            _print_error(
                "this command runs the Pulsing actor service, and Pulsing is not installed:"
                " install the 'service' extra (pip install -e '.[service]' in the source"
                " tree, or bash scripts/install.sh)"
            )
            sys.exit(EXIT_FAILED)
        sys.exit(result if isinstance(result, int) else 0)


def _print_error(message: str) -> None:
    stderr().print(
        f"[bold red]Error:[/] {escape(one_line(message))}", highlight=False, soft_wrap=True
    )


app = typer.Typer(
    cls=OneLineErrors,
    help="Persisting: a tiered KV-cache store and a durable Lance queue.",
    no_args_is_help=True,
    # Locals in a traceback could show a passphrase; a bug's traceback is enough without.
    pretty_exceptions_show_locals=False,
)
#: Distributions whose versions ``--version`` reports (what a bug report needs).
VERSIONED = ("pulsing", "pylance", "pyarrow", "torch", "lmcache")


def versions() -> str:
    """``persisting 0.1.0 (python 3.11.9; pulsing 0.1.2, pylance 14.0.2, ...)``, read from
    the installed metadata without importing anything heavy."""
    from importlib import metadata
    from platform import python_version

    found = []
    for name in VERSIONED:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    from persisting import __version__

    return f"persisting {__version__} (python {python_version()}; {', '.join(found)})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(versions())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the versions of Persisting and what it runs on, and exit.",
        ),
    ] = False,
) -> None:
    """Persisting: a tiered KV-cache store and a durable Lance queue."""


bench_app = typer.Typer(
    help="Trace-replay benchmark: generate a trace, replay it against a store, report.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench", rich_help_panel="Planning")


def command(group: typer.Typer, name: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """Register a function as a command of ``group``, with Persisting errors made readable."""

    def register(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except PersistingError as exc:
                code = EXIT_BAD_INPUT if isinstance(exc, ValueError) else EXIT_FAILED
                fail(flag_names(str(exc), exc.fields, click_context()), code)
            except OSError as exc:  # the machine said no (memory, space, permissions)
                fail(f"{exc.strerror or exc} ({type(exc).__name__})")

        group.command(name, **kwargs)(run)
        return fn

    return register


def click_context() -> Any:
    """The running command's context (its parameters name the flags), or None."""
    return get_current_context(silent=True)


def flag_names(message: str, fields: tuple[str, ...], ctx: Any) -> str:
    """``message`` with each input it names (``fields``, Python names) shown as the flag
    the user typed: ``tp=3 does not split kv_heads=8`` -> ``--tp=3 does not split
    --kv-heads=8``. Names with no flag of that command are left as they are."""
    flags = {}
    for param in getattr(getattr(ctx, "command", None), "params", []):
        opts = [o for o in param.opts if o.startswith("--")]
        if param.name and opts:
            flags[param.name] = opts[0]
        for opt in getattr(param, "secondary_opts", []):  # --no-mla of --mla/--no-mla
            flags[opt.removeprefix("--").replace("-", "_")] = opt
    for field in sorted(fields, key=len, reverse=True):
        if field in flags:
            message = re.sub(rf"(?<![\w-]){re.escape(field)}(?![\w-])", flags[field], message)
    return message


# ---------------------------------------------------------------------------------------
# Options several commands share
# ---------------------------------------------------------------------------------------

JsonFlag = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")
]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="TOML settings file (else PERSISTING_CONFIG and PERSISTING_* variables).",
        exists=True,
        dir_okay=False,
    ),
]
StoragePathOption = Annotated[
    Path | None,
    typer.Option("--storage-path", help="Storage root (default: the settings' storage_path)."),
]


def load_settings(config: Path | None, **overrides: Any) -> PersistingSettings:
    """Settings from ``--config`` (else PERSISTING_CONFIG), the environment and the flags
    given as ``overrides``; a mistake in any is a ConfigError."""
    from persisting.config import PersistingSettings

    return PersistingSettings.load(config, **overrides)


def main() -> None:
    """Console-script entry point (``persisting = persisting.cli:main``)."""
    app(prog_name="persisting")


__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "ConfigOption",
    "JsonFlag",
    "OneLineErrors",
    "StoragePathOption",
    "app",
    "bench_app",
    "command",
    "fail",
    "load_settings",
    "main",
    "one_line",
]
