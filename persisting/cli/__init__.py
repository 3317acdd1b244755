"""The ``persisting`` command line: the top of the house (it may import everything).

One module per family of commands, each registering on the app of :mod:`.app`:
:mod:`.plan` (capacity budget), :mod:`.bench` (trace replay), :mod:`.storage` (inspect,
drop, compact, stats), :mod:`.service` (serve, demo, prewarm), :mod:`.settings` (config).

Adding a command: write a small function in its family's module, register it with
``@command(app)`` (or ``@command(<sub-app>)``), take ``json_out: JsonFlag`` if a script
would want its output, and end with ``emit(data, json_out, render)``: the same data goes
to ``--json`` or to a rich rendering. ``command`` turns a :class:`PersistingError` into a
one-line message and an exit code (2 for bad input, 1 for everything else). Heavy imports
(torch, Lance, Pulsing) go inside the command that needs them, so ``--help`` and
``persisting plan`` stay instant.
"""

from persisting.cli import bench, plan, service, settings, storage  # noqa: F401  (they register)
from persisting.cli.app import app, main
from persisting.cli.output import to_jsonable

__all__ = ["app", "main", "to_jsonable"]
