"""An engine process whose parent died stops, instead of serving an orphan's figures.

vLLM's OpenAI server starts the engine core as a child process, and the engine core starts
its workers; a ``kill -9`` of the server's main process leaves them running, holding the
connector's metrics ports and the store open, with nobody left to send them work. In a
process vLLM started through ``multiprocessing`` (the engine core, a worker), the
connector watches its parent: once the parent is gone it closes its metrics ports and ends
the process with SIGTERM (vLLM's own handler shuts it down, closing the store), then
SIGKILL if it is still there after :data:`GRACE_S`. A process the user started directly is
never watched: its parent is a shell or a supervisor, not part of the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL of an orphaned engine process.
GRACE_S = 20.0

_STARTED = False
_LOCK = threading.Lock()


def watch_parent(on_orphaned: Callable[[], None]) -> bool:
    """Watch this process's parent (once per process) if vLLM started it through
    ``multiprocessing``; ``on_orphaned`` runs first when the parent dies. False when
    there is nothing to watch."""
    global _STARTED
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    with _LOCK:
        if _STARTED:
            return True
        _STARTED = True
    thread = threading.Thread(
        target=_watch,
        args=(parent.sentinel, parent.pid, on_orphaned),
        name="persisting-vllm-parent",
        daemon=True,
    )
    thread.start()
    return True


def _watch(sentinel: int, parent_pid: int | None, on_orphaned: Callable[[], None]) -> None:
    # The sentinel is readable once the parent is gone (unless a sibling forked later
    # inherited its other end): the parent's pid no longer being ours says it too.
    while not multiprocessing.connection.wait([sentinel], timeout=1.0):
        if parent_pid is not None and os.getppid() != parent_pid:
            break
    log.error(
        "Persisting: this engine process's parent (pid %s) is gone; closing the connector's"
        " metrics ports and stopping this orphaned process (pid %d)",
        parent_pid,
        os.getpid(),
    )
    try:
        on_orphaned()
    except Exception as exc:  # stopping goes on whatever happened
        log.warning("Persisting: closing after the parent died: %s", exc)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["GRACE_S", "watch_parent"]
