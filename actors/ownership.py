"""What a server claims before it serves: its models' namespaces and its event consumer.

A storage actor answers for the namespaces it serves from an index it keeps in memory, and
its event consumer applies and commits the topic's events: neither may run twice on one
storage root. :func:`claim_service` takes both claims (see
:mod:`persisting.lance_store.ownership`) *before* anything else starts -- the Pulsing
system, the stores -- so a second ``persisting serve`` on a live root ends at once with one
line naming the process that serves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from persisting.config import PersistingSettings
from persisting.lance_store import StorageRoot
from persisting.lance_store.ownership import LostHook, OwnerClaim


def server_what(name: str, addr: str | None) -> str:
    """How a server describes itself in its claims."""
    return f"persisting server {name!r} on {addr or 'an address not bound yet'}"


def consumer_what(name: str, addr: str | None) -> str:
    """How a server's event consumer describes itself in its claim."""
    return f"event consumer of {server_what(name, addr)}"


def consumer_name(name: str) -> str:
    """The committed-consumer name a server's event consumer uses."""
    return f"kv-service/{name}"


@dataclass
class ServiceClaims:
    """The claims one server holds; released when it stops (or its process ends)."""

    models: dict[str, OwnerClaim] = field(default_factory=dict)
    consumer: OwnerClaim | None = None

    def bound(self, name: str, addr: str) -> None:
        """Record the address the server listens on, now that it is known."""
        for claim in self.models.values():
            claim.update(server_what(name, addr), addr=addr)
        if self.consumer is not None:
            self.consumer.update(consumer_what(name, addr), addr=addr)

    def all(self) -> list[OwnerClaim]:
        claims = list(self.models.values())
        return [*claims, self.consumer] if self.consumer is not None else claims

    def watch(self, on_lost: LostHook) -> None:
        """Check every claim's lock file in the background; ``on_lost`` is told (once per
        claim) when one was removed and another process has claimed it since."""
        for claim in self.all():
            claim.watch(on_lost)

    def claim(
        self, settings: PersistingSettings, model: str, name: str, addr: str | None
    ) -> OwnerClaim:
        """Claim one more namespace for this server (a client opened it)."""
        claim = claim_models(settings, [model], name=name, addr=addr)[model]
        self.models[model] = claim
        return claim

    def drop(self, model: str) -> None:
        """Release the claim on ``model`` (its store did not open)."""
        claim = self.models.pop(model, None)
        if claim is not None:
            claim.release()

    def release(self) -> None:
        for claim in self.all():
            claim.release()


def claim_models(
    settings: PersistingSettings, models: Sequence[str], *, name: str, addr: str | None
) -> dict[str, OwnerClaim]:
    """Claim every model's namespace for a server (all or none)."""
    root = StorageRoot(settings.storage_path, settings.storage_access)
    claims: dict[str, OwnerClaim] = {}
    details = {"name": name, "addr": addr, "models": list(models)}
    try:
        for model in models:
            claims[model] = root.claim_model(model, "server", server_what(name, addr), details)
    except BaseException:
        for claim in claims.values():
            claim.release()
        raise
    return claims


def claim_consumer(
    settings: PersistingSettings,
    models: Sequence[str],
    *,
    name: str,
    addr: str | None,
    topic: str | None = None,
) -> OwnerClaim:
    """Claim the event consumer of the server ``name`` (serving ``models``) on its topic."""
    root = StorageRoot(settings.storage_path, settings.storage_access)
    topic = topic or settings.service.event_topic
    return root.claim_consumer(
        topic,
        consumer_name(name),
        consumer_what(name, addr),
        {"name": name, "addr": addr, "topic": topic, "models": list(models)},
    )


def claim_service(
    settings: PersistingSettings,
    models: Sequence[str],
    *,
    name: str,
    addr: str | None,
    consume_events: bool,
) -> ServiceClaims:
    """Claim the models and (if events are consumed) the event consumer, or nothing."""
    claims = ServiceClaims(claim_models(settings, models, name=name, addr=addr))
    if consume_events and settings.service.event_topic:
        try:
            claims.consumer = claim_consumer(settings, models, name=name, addr=addr)
        except BaseException:
            claims.release()
            raise
    return claims


__all__ = [
    "ServiceClaims",
    "claim_consumer",
    "claim_models",
    "claim_service",
    "consumer_name",
    "consumer_what",
    "server_what",
]
