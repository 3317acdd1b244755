"""The cluster as an operator sees it: every server of a service, its state and figures.

``persisting stats --service IP:PORT`` (several seeds allowed) joins the cluster through any
live seed, lists the storage actors registered under the service's name -- alive or not,
as the cluster's gossip knows them -- and asks each one for its ``stats`` (no session,
nothing held). A server that is registered but does not answer is shown ``unreachable``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pulsing

from persisting.config import PersistingSettings
from persisting.errors import ConfigError, PersistingError, ServiceUnavailableError
from persisting.service.client.member import TRANSPORT_ERRORS, describe_failure
from persisting.service.client.transport import with_timeout
from persisting.service.passphrase import client_passphrase
from persisting.service.protocol import make_request, safe_loads, unwrap_reply


@dataclass
class MemberView:
    """One server of the service: where it is, its state, and what it reported."""

    addr: str
    #: ``up`` (answered), ``unreachable`` (registered, no answer) or the cluster's own
    #: state for a member it no longer counts as alive (``Dead``, ``Suspect``...).
    state: str
    error: str | None = None
    node: dict[str, Any] = field(default_factory=dict)
    service: dict[str, Any] = field(default_factory=dict)
    stores: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[str, Any] | None = None


@dataclass
class ClusterView:
    """What :func:`survey_cluster` found."""

    name: str
    seeds: list[str]
    members: list[MemberView]

    @property
    def up(self) -> int:
        return sum(1 for m in self.members if m.state == "up")


async def survey_cluster(
    seeds: Sequence[str],
    *,
    name: str | None = None,
    settings: PersistingSettings | None = None,
    passphrase: str | None = None,
    timeout_s: float = 10.0,
) -> ClusterView:
    """Join through ``seeds`` and ask every server of ``name`` for its figures."""
    settings = settings or PersistingSettings()
    service = settings.service
    name = name or service.name
    if not seeds:
        raise ConfigError("give at least one server address (IP:PORT) to find the cluster by")
    secret = client_passphrase(passphrase, service)
    owns = not pulsing.is_initialized()
    if owns:
        await pulsing.init(addr=None, seeds=list(seeds), passphrase=secret)
    try:
        system = pulsing.get_system()
        instances = await _settled_instances(system, name, timeout_s)
        if not instances:
            raise ServiceUnavailableError(
                f"no {name!r} server found through {', '.join(seeds)} in {timeout_s:g}s "
                "(is one up, and the passphrase right?)"
            )
        views = await asyncio.gather(
            *(_ask(system, name, item, timeout_s) for item in instances.values())
        )
    finally:
        if owns:
            with contextlib.suppress(Exception):
                await pulsing.shutdown()
    return ClusterView(name, list(seeds), sorted(views, key=lambda v: v.addr))


async def _settled_instances(system: Any, name: str, timeout_s: float) -> dict[str, Any]:
    """The registered instances of ``name`` once two reads a moment apart agree (gossip
    brings the members in over the first second or so)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    previous: dict[str, Any] | None = None
    while True:
        try:
            found = await system.get_named_instances(name)
        except TRANSPORT_ERRORS:
            found = []
        current = {str(i["addr"]): i for i in found if i.get("addr")}
        stable = previous is not None and set(current) == set(previous)
        if (current and stable) or loop.time() >= deadline:
            return current
        previous = current
        await asyncio.sleep(0.5)


async def _ask(system: Any, name: str, instance: dict[str, Any], timeout_s: float) -> MemberView:
    addr = str(instance["addr"])
    status = str(instance.get("status", "Alive"))
    view = MemberView(addr, "up" if status == "Alive" else status)
    try:
        ref = await with_timeout(
            system.resolve_named(name, node_id=int(instance["node_id"])), timeout_s
        )
        reply = await with_timeout(ref.ask(make_request("stats")), timeout_s)
        payload = getattr(reply, "payload", None)
        if payload is not None and not isinstance(reply, dict):
            reply = safe_loads(payload)
        stats = unwrap_reply(reply)
    except (*TRANSPORT_ERRORS, PersistingError) as exc:
        if view.state == "up":
            view.state = "unreachable"
        view.error = describe_failure(exc)
        return view
    view.node = dict(stats.get("node") or {})
    view.service = dict(stats.get("service") or {})
    view.stores = dict(stats.get("stores") or {})
    events = stats.get("events")
    view.events = dict(events) if isinstance(events, dict) else None
    if view.state != "up":  # it answered: the gossip's verdict is stale
        view.state = "up"
    return view


__all__ = ["ClusterView", "MemberView", "survey_cluster"]
