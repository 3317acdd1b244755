"""vLLM's scheduler on a cluster of ``persisting serve`` members (the ``cluster`` key), for
both ``PersistingTier`` and the connector's CPU path (its manager).

The tier's rows move through the engine adapters' store
(:func:`~persisting.integrations.common.opener.open_engine_store`: a
:class:`~persisting.integrations.common.cluster.ClusterStore`): a store job's rows are
written with one ``write_from`` (one request per member holding some of them), a promotion's
read with one ``read_into`` straight into the CPU tier's rows.

vLLM's scheduler asks a tier chunk by chunk, on its own thread, and must never wait on the
network. So :class:`ClusterCatalog` answers from what it has learnt: a chunk not asked about
yet is a ``RETRY`` (vLLM asks again next step), collected with the step's other new keys;
at the step's end (``on_schedule_end``) they go, all at once, in one presence question
(:meth:`~persisting.integrations.common.store.EngineStore.exists`: one round trip per
member), answered on a thread of the catalog's own. One question is in flight at a time:
keys asked meanwhile wait for the next step. A chunk no answer has come for within
:data:`WAIT_S` is a miss (the engine recomputes rather than waits on a member that does not
answer), and so is every chunk of a question that failed. A presence is remembered (until a
promotion of the chunk fails); an absence for ``refresh_interval_s``, then asked again
(another engine may have stored it since). The connector's CPU manager answers from the same
catalog, block by block (its worker reads and writes blocks with the same store's
``read_into`` and ``write_from``). Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from persisting.integrations.common.store import EngineStore

log = logging.getLogger(__name__)

Answer = Literal["hit", "pending", "miss", "retry"]
#: Seconds a chunk waits for the cluster's answer before it is a miss.
WAIT_S = 2.0
#: Answers remembered at most (the oldest are asked again).
MAX_ANSWERS = 1 << 20


class ClusterCatalog:
    """What the scheduler has learnt of a cluster's chunks (thread-safe)."""

    def __init__(
        self,
        store: EngineStore,
        refresh_interval_s: float,
        on_gone: Callable[[list[str]], None] | None = None,
        wait_s: float = WAIT_S,
    ):
        self.store = store
        self.recheck_s = refresh_interval_s
        self.wait_s = wait_s
        self.on_gone = on_gone
        self._lock = threading.Lock()
        #: key -> (present, when learnt), oldest first.
        self._answers: OrderedDict[str, tuple[bool, float]] = OrderedDict()
        self._storing: set[str] = set()
        #: Keys asked about and not answered yet -> when first asked.
        self._asked: dict[str, float] = {}
        self._batch: list[str] = []
        self._question: Future[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="persisting-vllm-exists")

    # -- the scheduler's questions (memory only) ----------------------------------------

    def lookup(self, key: str) -> Answer:
        now = time.monotonic()
        with self._lock:
            if key in self._storing:
                return "pending"
            answer = self._answers.get(key)
            if answer is not None and (answer[0] or now - answer[1] < self.recheck_s):
                return "hit" if answer[0] else "miss"
            asked = self._asked.get(key)
            if asked is None:
                self._asked[key] = now
                self._batch.append(key)
                return "retry"
            return "retry" if now - asked < self.wait_s else "miss"

    def __contains__(self, key: str) -> bool:
        with self._lock:
            answer = self._answers.get(key)
        return answer is not None and answer[0]

    def flush(self) -> None:
        """The step ended: send the keys it asked about, unless a question is in flight."""
        with self._lock:
            if not self._batch or (self._question is not None and not self._question.done()):
                return
            keys, self._batch = self._batch, []
        try:
            self._question = self._pool.submit(self._ask, keys)
        except RuntimeError:  # closed
            self._learn(keys, [False] * len(keys))

    def end_step(self) -> None:
        """vLLM's ``on_schedule_end``: :meth:`flush`, never raising into vLLM (the step's
        keys are then misses after ``wait_s``)."""
        try:
            self.flush()
        except Exception as exc:
            log.warning("Persisting: asking the cluster failed: %s", exc)

    def refresh(self) -> None:
        """Nothing to rescan: absences are asked again after ``refresh_interval_s``."""

    def busy(self) -> bool:
        """Whether keys wait to be asked about, or for their answer."""
        with self._lock:
            return bool(self._batch) or bool(self._asked)

    def claim_stores(self, keys: Iterable[str]) -> list[str]:
        """Of ``keys``, those to store now (not known present, not being stored), marked as
        being stored."""
        with self._lock:
            todo = [
                k
                for k in dict.fromkeys(keys)
                if k not in self._storing and not self._answers.get(k, (False, 0.0))[0]
            ]
            self._storing.update(todo)
        return todo

    def stored(self, keys: Iterable[str], ok: bool = True) -> None:
        keys = list(keys)
        with self._lock:
            self._storing.difference_update(keys)
        if ok:
            self._learn(keys, [True] * len(keys))

    def abandon_stores(self) -> None:
        with self._lock:
            self._storing.clear()

    # -- what the I/O threads learn -------------------------------------------------------

    def fail(self, keys: Iterable[str]) -> None:
        """Promotions of ``keys`` failed: misses (asked again after ``refresh_interval_s``)."""
        keys = list(keys)
        self._learn(keys, [False] * len(keys))
        if keys and self.on_gone is not None:
            self.on_gone(keys)

    def forget(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._learn(keys, [False] * len(keys))

    def _ask(self, keys: list[str]) -> None:
        try:
            flags = self.store.exists(keys)
        except Exception as exc:  # never into vLLM: a question that fails is misses
            log.warning("Persisting: asking the cluster for %d chunks failed: %s", len(keys), exc)
            flags = [False] * len(keys)
        self._learn(keys, flags)

    def _learn(self, keys: Sequence[str], flags: Sequence[bool]) -> None:
        now = time.monotonic()
        with self._lock:
            for key, present in zip(keys, flags, strict=True):
                self._asked.pop(key, None)
                self._answers[key] = (bool(present), now)
                self._answers.move_to_end(key)
            while len(self._answers) > MAX_ANSWERS:
                self._answers.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["WAIT_S", "Answer", "ClusterCatalog"]
