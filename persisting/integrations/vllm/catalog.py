"""Which blocks of a namespace vLLM's scheduler may be offered: answered from memory.

vLLM's scheduler asks block by block, on its own thread, and must never wait on a disk or
a lock another thread holds while scanning one. So both scheduler-side parts (the
connector's manager on the CPU path, ``PersistingTier`` behind vLLM's CPU tier) answer
from a :class:`BlockCatalog`: the keys on disk as of the last rescan of the namespace, plus
every store this engine completed; a background thread rescans every
``refresh_interval_s`` for blocks other engines stored and blocks evicted or removed.

A block whose load failed -- damaged, gone, laid out differently, an I/O error -- is
:meth:`~BlockCatalog.fail`\\ ed: a miss from then on, until it is stored afresh (by this
engine, or by another one: a rescan that finds a *new* file for the key offers it again).
Without that, vLLM would look the block up again for the retried request, load it, fail
and retry for ever. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Literal

from persisting.kv import KVStore

log = logging.getLogger(__name__)

Answer = Literal["hit", "pending", "miss"]


class BlockCatalog:
    """The offerable keys of one namespace, kept by one scheduler (thread-safe)."""

    def __init__(
        self,
        store: KVStore,
        refresh_interval_s: float,
        on_gone: Callable[[list[str]], None] | None = None,
    ):
        self.store = store
        self.refresh_interval_s = refresh_interval_s
        #: Told of keys that vanished (evicted, removed, failed): a manager reports them
        #: to vLLM as evicted. Called with the catalog's lock released.
        self.on_gone = on_gone
        self._lock = threading.Lock()
        self._known: set[str] = {key for key, _size in store.stored_keys()}
        self._storing: set[str] = set()
        #: Keys whose load failed -> the file they were in then (None: no file).
        self._failed: dict[str, str | None] = {}
        self._stop = threading.Event()
        self._refresher = threading.Thread(
            target=self._refresh_loop, name="persisting-vllm-refresh", daemon=True
        )
        self._refresher.start()

    # -- the scheduler's questions (memory only) ----------------------------------------

    def lookup(self, key: str) -> Answer:
        with self._lock:
            if key in self._storing:
                return "pending"
            return "hit" if key in self._known else "miss"

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._known

    def claim_stores(self, keys: Iterable[str]) -> list[str]:
        """Of ``keys``, those to store now (neither stored nor being stored), marked as
        being stored."""
        with self._lock:
            known, storing = self._known, self._storing
            todo = [k for k in dict.fromkeys(keys) if k not in known and k not in storing]
            self._storing.update(todo)
        return todo

    def stored(self, keys: Iterable[str], ok: bool = True) -> None:
        """A store of ``keys`` ended: with ``ok`` they are on disk (stored afresh, which
        also clears a failed load of theirs)."""
        keys = list(keys)
        with self._lock:
            self._storing.difference_update(keys)
            if ok:
                self._known.update(keys)
                for key in keys:
                    self._failed.pop(key, None)

    def abandon_stores(self) -> None:
        """Forget the stores in flight (vLLM's cache reset drops their jobs unfinished)."""
        with self._lock:
            self._storing.clear()

    # -- what the I/O threads learn -------------------------------------------------------

    def fail(self, keys: Iterable[str]) -> None:
        """Loads of ``keys`` failed: misses until stored afresh."""
        keys = list(keys)
        files = {key: self._file_of(key) for key in keys}
        with self._lock:
            self._known.difference_update(keys)
            self._failed.update(files)
        self._tell_gone(keys)

    def forget(self, keys: Iterable[str]) -> None:
        """``keys`` were removed (evicted, an evict event): misses from now on."""
        with self._lock:
            gone = [k for k in keys if k in self._known]
            self._known.difference_update(gone)
        self._tell_gone(gone)

    def _tell_gone(self, keys: list[str]) -> None:
        if keys and self.on_gone is not None:
            self.on_gone(keys)

    def _file_of(self, key: str) -> str | None:
        """The file ``key`` is in now, as this process's store knows it (no lease held:
        a zero-second lease only says where the bytes are)."""
        try:
            location = self.store.lease(key, 0.0)
        except Exception:  # a store closed meanwhile: nothing to compare with later
            return None
        return location.path if location is not None else None

    # -- rescans --------------------------------------------------------------------------

    def _refresh_loop(self) -> None:
        while not self._stop.wait(max(self.refresh_interval_s, 0.05)):
            try:
                self.refresh()
            except Exception as exc:  # a rescan that fails is tried again next time
                log.warning("Persisting: rescanning %s failed: %s", self.store.model, exc)

    def refresh(self) -> None:
        """Rescan the namespace: blocks others stored become hits, vanished ones misses (told
        to ``on_gone``); a failed block stays a miss unless its file was replaced."""
        with self._lock:
            before = set(self._known)
            failed = dict(self._failed)
        self.store.refresh()
        now = {key for key, _size in self.store.stored_keys()}
        renewed = {k for k, path in failed.items() if k in now and self._file_of(k) != path}
        with self._lock:
            added_meanwhile = self._known - before
            for key in failed:
                if key not in now or key in renewed:
                    self._failed.pop(key, None)
            self._known = (now - self._failed.keys()) | added_meanwhile
            gone = sorted(before - now - added_meanwhile)
        self._tell_gone(gone)

    def close(self) -> None:
        self._stop.set()
        self._refresher.join(timeout=30)


__all__ = ["Answer", "BlockCatalog"]
