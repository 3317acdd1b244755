"""Where Persisting works around how Pulsing behaves: one module, so upgrading Pulsing is
one diff.

Every workaround below was written against Pulsing :data:`PULSING_VERSION` (the version
pyproject pins in the ``service`` extra; ``tests/test_pulsing_compat.py`` fails when the
installed Pulsing is another). To upgrade: check each numbered entry against the new
release, delete what it fixed (and the call sites named), then change the version here and
in pyproject.

1. **The launcher builds the actor bare, then starts the system without a passphrase.**
   ``pulsing actor <class>`` passes no constructor arguments and calls
   ``pulsing.core.init(addr, seeds=...)`` after building the actor. The storage actor
   reads its settings itself when built bare (``actors/kv_cache_storage.py``) and
   :func:`intercept_launcher_init` makes that one ``init`` start with the server's
   passphrase (``actors/system.py``).
2. **A process may crash at interpreter exit after ``pulsing.shutdown()``**: Pulsing's
   threads release the objects they hold while the interpreter is being torn down. A
   server (``actors/launch.py``), ``persisting stats --service`` (``cli/storage.py``)
   and the queue's examples (``docs/queue.md``, ``docs/user-guide.md``: seen in CI as an
   abort or a segfault after the script's last line) end with
   :func:`exit_after_shutdown`; the client drops every actor reference it holds before it
   shuts its own system down (``KVCacheClient.close`` in
   ``service/client/kv_cache_client.py``).
3. **An ask is refused outright ("Connection pool exhausted")** when about 12 connections
   to one peer are opened at once from a cold start, below the pool's 16. Such an ask was
   never sent, so the client retries it after a pause (:func:`is_pool_exhausted`, in
   ``service/client/transport.py``) instead of taking the member for dead.
4. **A queue reader's ``get(wait=True, timeout=t)`` waits up to ``t`` per bucket**, and a
   bucket holding some records waits for ``limit`` of them: one record in a topic of 4
   buckets took 4 x ``t``. :func:`get_within` bounds the whole wait
   (``queue/api.py``, ``TopicReader``).
5. **Pulsing never closes a bucket's storage backend**, so an actor system restarted in the
   same process opens the bucket again while the old backend still holds it: within a
   process the newest writer wins and the previous one is flushed and closed first
   (``queue/ownership.py``, ``close_previous_writer``).

Nothing here imports Pulsing at import time: the queue's Lance storage loads without it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

#: The Pulsing release every workaround of this module was written against.
PULSING_VERSION = "0.1.2"


# -- 1. the launcher ----------------------------------------------------------------------

#: Starts a Pulsing system the way the launcher asked (``addr``, ``seeds``, its other
#: keyword arguments) through the original ``pulsing.core.init``.
LauncherInit = Callable[[Callable[..., Awaitable[Any]], str | None, Any, dict[str, Any]], Any]


def intercept_launcher_init(start: LauncherInit) -> None:
    """Make the next ``pulsing.core.init`` call (the launcher's) go through ``start``,
    given the original ``init``, the address, the seeds and the other keyword arguments.
    One shot: the original is back in place before ``start`` runs. Arming twice is one
    interception."""
    import pulsing.core

    original = pulsing.core.init
    if getattr(original, "persisting_armed", False):
        return

    async def init(addr: str | None = None, *, seeds: Any = None, **kwargs: Any) -> Any:
        pulsing.core.init = original  # one shot
        return await start(original, addr, seeds, kwargs)

    init.persisting_armed = True  # type: ignore[attr-defined]
    pulsing.core.init = init


# -- 2. exit after shutdown ----------------------------------------------------------------


def exit_after_shutdown(status: int = 0) -> None:
    """End the process now (output flushed), skipping the interpreter's teardown in which
    Pulsing's threads may crash it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# -- 3. connection pool exhausted ----------------------------------------------------------

#: Pulsing's refusal to open one more connection to a peer (the ask was not sent).
POOL_EXHAUSTED = "Connection pool exhausted"


def is_pool_exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` is Pulsing refusing an ask it never sent (worth a retry)."""
    return POOL_EXHAUSTED in str(exc)


# -- 4. a reader's bounded wait ------------------------------------------------------------


class _Reader(Protocol):
    async def get(self, limit: int = 100) -> list[dict[str, Any]]: ...


async def get_within(
    reader: _Reader,
    limit: int,
    wait: bool,
    timeout: float | None,
    poll_interval_s: float,
) -> list[dict[str, Any]]:
    """Up to ``limit`` records ``reader`` holds now; with ``wait`` and none, looks again
    every ``poll_interval_s`` until one comes, at most ``timeout`` seconds in all when it
    is truthy (for as long as it takes otherwise, as in Pulsing)."""
    deadline = time.monotonic() + timeout if timeout else None
    while True:
        records = await reader.get(limit)
        if records or not wait:
            return records
        pause = poll_interval_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return records
            pause = min(pause, left)
        await asyncio.sleep(pause)


def installed_pulsing_version() -> str | None:
    """The installed Pulsing's version, or None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("pulsing")
    except metadata.PackageNotFoundError:
        return None


#: Call sites, for the upgrade diff (each names this module).
CALL_SITES: Sequence[str] = (
    "actors/kv_cache_storage.py",
    "actors/system.py",
    "actors/launch.py",
    "persisting/cli/storage.py",
    "persisting/service/client/kv_cache_client.py",
    "persisting/service/client/transport.py",
    "persisting/queue/api.py",
    "persisting/queue/ownership.py",
)


__all__ = [
    "CALL_SITES",
    "POOL_EXHAUSTED",
    "PULSING_VERSION",
    "LauncherInit",
    "exit_after_shutdown",
    "get_within",
    "installed_pulsing_version",
    "intercept_launcher_init",
    "is_pool_exhausted",
]
