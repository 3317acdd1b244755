"""A member's replicator: it sends the other copies of the keys it holds (see
:mod:`persisting.service.replication` for the rules).

It runs on a thread of its own, with its own event loop: the data path tells it which keys
were read or stored (:meth:`Replicator.noted`), the members watcher which members are
alive (:meth:`Replicator.members`). For each batch of keys to check it asks each target
member once which keys it has (``contains``), reads the others from this member's store
(checksum checked: a damaged value is never sent; a memory-tier value is sent from the
tier's own buffer, uncopied) and puts them on the target over the data path -- a client
of its own peers, with the cluster's passphrase and TLS, at ``service.copy_bytes_per_s``.
The target stores a copy through its ordinary put path, so its budget holds. A target
that fails costs nothing but the copy: the keys are checked again when the members change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

from persisting.config import PersistingSettings
from persisting.errors import PersistingError
from persisting.kv import KVStore, Layout
from persisting.kv.layout import checksum
from persisting.service import KVCacheClient
from persisting.service.client.member import MemberFailed
from persisting.service.replication import CopyBacklog, Pacer, copy_targets

logger = logging.getLogger("persisting.replicas")

#: Keys checked per step, and the bytes read into memory before they are sent.
STEP_KEYS = 256
STEP_BYTES = 64 << 20
#: The pause before copies that failed to reach a live member are tried again.
RETRY_S = 1.0


class Replicator:
    """Sends copies of this member's wanted keys to the members that should hold them."""

    def __init__(
        self, settings: PersistingSettings, name: str, stores: Mapping[str, KVStore]
    ) -> None:
        service = settings.service
        self.settings = settings
        self.name = name
        self.stores = stores
        self.replicas = service.replicas
        self.copy_on = service.copy_on
        self.backlog = CopyBacklog()
        self.pacer = Pacer(service.copy_bytes_per_s)
        self.counters: Counter[str] = Counter()
        self._me: str | None = None
        self._live: list[str] | None = None
        self._clients: dict[str, KVCacheClient] = {}
        #: Namespaces whose keys were surveyed since this member started.
        self._surveyed: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- told by the server ---------------------------------------------------------------

    def noted(self, model: str, keys: list[str], how: str) -> None:
        """Keys were read (``"read"``), stored (``"put"``) or received as a copy from
        another member (``"copy"``: wanted by definition, so this member heals it too when
        the others are lost): those that now deserve copies join the backlog (the data
        path's hook; cheap, never blocks on I/O)."""
        if self.replicas > 1 and (how in ("read", "copy") or self.copy_on == "put"):
            self.counters["keys_wanted"] += self.backlog.want(model, keys)

    def members(self, me: str, live: list[str]) -> None:
        """The members seen alive now: a change (one joined, came back or was lost)
        checks every wanted key's copies again."""
        changed = self._live is not None and sorted(live) != sorted(self._live)
        self._me, self._live = me, sorted(live)
        if changed:
            self.counters["rechecks"] += 1
            self.backlog.recheck()

    def status(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "copy_on": self.copy_on,
            "copy_bytes_per_s": self.pacer.bytes_per_s,
            "due": self.backlog.due,
            **dict(self.counters),
        }

    # -- the thread -----------------------------------------------------------------------

    def start(self) -> None:
        if self.replicas < 2 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="persisting-copies", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.backlog.wake()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def _main(self) -> None:
        # Not run at a lower priority: a thread's nice level passes to every thread it
        # starts, and the store starts its pools and a namespace's background threads when
        # first needed -- from this thread, if a copy needs them first -- which would then
        # serve every request at that level. Copies are bounded by their rate instead.
        try:
            asyncio.run(self._run())
        except Exception:  # the replicator must never take the server down
            logger.exception("persisting: the replicator stopped")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stop.is_set():
                await self._survey_new()
                batch = await loop.run_in_executor(None, self.backlog.take, STEP_KEYS, 0.5)
                if batch and not self._stop.is_set():
                    await self._step(batch)
        finally:
            for client in self._clients.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 5.0)

    async def _step(self, batch: list[tuple[str, str]]) -> None:
        me, live = self._me, self._live or []
        if me is None or len(live) < 2:
            return  # nobody to copy to: the keys stay wanted, checked when members change
        unsure = self.backlog.unsure(batch)
        if unsure:
            await self._judge(sorted(unsure), me, live)
        groups: dict[tuple[str, str], list[str]] = {}
        for model, key in batch:
            if (model, key) in unsure:
                continue
            for target in copy_targets(key, live, me, self.replicas):
                groups.setdefault((model, target), []).append(key)
        failed = False
        for (model, target), keys in groups.items():
            try:
                await self._copy(model, target, keys)
            except Exception as exc:  # a target gone, restarting or refusing
                if isinstance(exc, MemberFailed):  # out of use until it answers (or restarts)
                    self._clients[model].cluster.failed(exc)
                self.counters["copy_failures"] += len(keys)
                logger.debug(
                    "persisting: copies of %d key(s) to %s failed: %s", len(keys), target, exc
                )
                if target in (self._live or []):  # still a member: try again after a pause
                    self.backlog.retry(model, keys)
                    failed = True
        if failed:
            await asyncio.sleep(RETRY_S)

    async def _survey_new(self) -> None:
        """Survey the keys of each namespace this member held before it started (once the
        members are known; a namespace opened later is surveyed when it is)."""
        if self._me is None or len(self._live or []) < 2 or self.replicas < 2:
            return
        loop = asyncio.get_running_loop()
        for model, store in list(self.stores.items()):
            if model in self._surveyed or store.closed:
                continue
            self._surveyed.add(model)
            held = await loop.run_in_executor(None, store.stored_keys)
            # the most recently used last: those kept when there are more than a member
            # remembers
            keys = [key for key, _ in held[-self.backlog.max_wanted :]]
            self.counters["keys_surveyed"] += self.backlog.survey(model, keys)

    async def _judge(self, unsure: list[tuple[str, str]], me: str, live: list[str]) -> None:
        """Surveyed keys another live member holds are wanted (copies are only ever made of
        wanted keys); the others are asked about again when the members change."""
        by_model: dict[str, list[str]] = {}
        for model, key in unsure:
            by_model.setdefault(model, []).append(key)
        for model, keys in by_model.items():
            wanted: set[str] = set()
            for target in (m for m in live if m != me):
                try:
                    present = await self._present(await self._client(model), target, keys)
                except Exception as exc:  # asked again when the members change
                    logger.debug("persisting: survey on %s failed: %s", target, exc)
                    continue
                wanted.update(k for k, have in zip(keys, present, strict=True) if have)
            self.counters["keys_wanted"] += self.backlog.want(model, sorted(wanted))

    async def _copy(self, model: str, target: str, keys: list[str]) -> None:
        store = self.stores.get(model)
        if store is None:
            return
        client = await self._client(model)
        present = await self._present(client, target, keys)
        missing = [k for k, have in zip(keys, present, strict=True) if not have]
        self.counters["copies_present"] += len(keys) - len(missing)
        loop = asyncio.get_running_loop()
        while missing:
            got = await loop.run_in_executor(None, _read_local, store, missing, STEP_BYTES)
            missing = missing[got.taken :]
            self.counters["copies_gone"] += got.gone
            if not got.keys:
                continue
            nbytes = sum(layout.nbytes for layout in got.layouts)
            await loop.run_in_executor(None, self.pacer.spend, nbytes)
            results = await client.put_on(target, got.keys, got.payloads, got.layouts)
            self.counters["copies_sent"] += sum(1 for r in results if r.stored)
            self.counters["copy_bytes"] += nbytes

    @staticmethod
    async def _present(client: KVCacheClient, target: str, keys: list[str]) -> list[bool]:
        """Which of ``keys`` member ``target`` holds."""
        cluster = client.cluster
        if target not in cluster.members or not cluster.membership.is_live(target):
            await cluster.discover()  # new, or restarted since (a new node id: a new session)
        return await client.contains_on(target, keys)

    async def _client(self, model: str) -> KVCacheClient:
        """This member's client of ``model`` on its peers (this process's Pulsing system,
        so the cluster's passphrase; TCP and TLS to every member)."""
        client = self._clients.get(model)
        if client is None:
            client = await KVCacheClient.connect(
                name=self.name, model=model, settings=self.settings, same_host=False, role="copies"
            )
            self._clients[model] = client
        return client


class _Read:
    """Values read from the local store for one put: their keys, payloads and layouts,
    how many keys were taken from the list and how many were gone."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.payloads: list[Any] = []
        self.layouts: list[Layout] = []
        self.taken = 0
        self.gone = 0


def _read_local(store: KVStore, keys: list[str], max_bytes: int) -> _Read:
    """Read ``keys`` from ``store`` (in order, up to ``max_bytes``); a key evicted or
    damaged since is skipped and counted as gone.

    A value in the memory tier is sent from the tier's own buffer (held until it is sent,
    as the data path's gets do) once its bytes were found to match the checksum stored
    with it: no copy, no fresh pages to fault in, and no damaged value sent. A value on
    disk only is read into a buffer of its own, the store checking it (and quarantining it
    if damaged)."""
    out = _Read()
    used = 0
    for key in keys:
        if out.keys and used >= max_bytes:
            break
        out.taken += 1
        try:
            got = _read_one(store, key)
        except PersistingError:
            got = None
        if got is None:
            out.gone += 1
            continue
        layout, payload = got
        out.keys.append(key)
        out.payloads.append(payload)
        out.layouts.append(layout)
        used += layout.nbytes
    return out


def _read_one(store: KVStore, key: str) -> tuple[Layout, Any] | None:
    """``key``'s layout and bytes to send, or None: gone, or damaged."""
    held = store.memory_payload(key)
    if held is not None:
        view = held.buffer.data.cast("B")  # holds the buffer (its pool range) until sent
        return (held.layout, view) if checksum(view) == held.checksum else None
    layout = store.layout(key)
    if layout is None:
        return None
    buffer = bytearray(layout.nbytes)
    if store.get_into(key, buffer, expect=layout) is None:
        return None
    return layout, buffer


__all__ = ["Replicator"]
