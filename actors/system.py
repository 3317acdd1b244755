"""Starting Pulsing for a server so that nothing answers an unauthenticated peer.

Every Pulsing process listens on a TCP port and unpickles what arrives before an actor sees
it; only a passphrase (TLS) keeps a stranger from running code in it
(:mod:`persisting.service.passphrase`). :func:`start_system` starts Pulsing with the
server's passphrase and remembers the system as authenticated; a storage actor refuses to
be built in a system that was not started that way.

Pulsing's own launcher (``pulsing actor <class> ...``) builds the actor first and then
calls ``pulsing.core.init(addr=..., seeds=...)`` with no passphrase (entry 1 of
:mod:`persisting.pulsing_compat`). :func:`arm_launcher`, called by the actor's constructor
when no system exists yet, makes that one call start with the server's passphrase. Should
a launcher start the system some other way, the actor finds it unauthenticated when it is
spawned, and ends the process rather than serve (:func:`require_authenticated`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pulsing

from persisting.config import ServiceSettings
from persisting.errors import ConfigError
from persisting.pulsing_compat import intercept_launcher_init
from persisting.service.passphrase import passphrase_file, server_passphrase

logger = logging.getLogger("persisting.service")

#: Systems this process started with a passphrase (by id; one per process in practice),
#: with where the passphrase came from (for the banner; never the passphrase itself).
_AUTHENTICATED: dict[int, str] = {}


async def start_system(
    service: ServiceSettings, addr: str | None, seeds: Sequence[str] | None
) -> Any:
    """Start this process's Pulsing system with the server's passphrase."""
    secret = server_passphrase(service, addr, list(seeds or ()))
    system = await pulsing.init(addr=addr, seeds=list(seeds or ()) or None, passphrase=secret)
    _AUTHENTICATED[id(system)] = _source(service)
    return system


def _source(service: ServiceSettings) -> str:
    return "configured" if service.passphrase else f"generated, in {passphrase_file(service)}"


def passphrase_source(system: Any) -> str:
    """Where ``system``'s passphrase came from ("configured", or the file it is kept in)."""
    return _AUTHENTICATED.get(id(system), "none")


def is_authenticated(system: Any) -> bool:
    """Whether ``system`` was started here with a passphrase (see :func:`start_system`)."""
    return id(system) in _AUTHENTICATED


def arm_launcher(service: ServiceSettings) -> None:
    """Make the next ``pulsing.core.init`` (the launcher's) start with our passphrase.

    A refusal (a non-loopback address without a configured passphrase) is one line on
    stderr and exit status 2, not a traceback from inside the launcher.
    """

    async def start(
        original: Callable[..., Awaitable[Any]], addr: str | None, seeds: Any, kwargs: dict
    ) -> Any:
        kwargs.pop("passphrase", None)
        try:
            secret = server_passphrase(service, addr, list(seeds or ()))
        except ConfigError as exc:
            print(f"persisting: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        system = await original(addr, seeds=seeds, passphrase=secret, **kwargs)
        _AUTHENTICATED[id(system)] = _source(service)
        return system

    intercept_launcher_init(start)


def require_authenticated() -> None:
    """End this process if its Pulsing system answers peers without a passphrase."""
    system = pulsing.get_system() if pulsing.is_initialized() else None
    if system is not None and not is_authenticated(system):
        message = (
            "persisting: refusing to serve: this Pulsing system was started without "
            "Persisting's passphrase (use `persisting serve`, or start_system())"
        )
        logger.critical(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(2)


__all__ = [
    "arm_launcher",
    "is_authenticated",
    "passphrase_source",
    "require_authenticated",
    "start_system",
]
