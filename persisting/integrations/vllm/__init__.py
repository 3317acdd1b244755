"""vLLM integration: ``PersistingConnector``, vLLM's offloading connector over Persisting.

::

    LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="PersistingConnector",
        kv_connector_module_path="persisting.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"storage_path": "/var/lib/persisting"}))

On a GPU engine the connector puts :class:`PersistingTier` behind vLLM's own CPU tier; a
user configuring vLLM's ``OffloadingConnector`` directly names it in ``secondary_tiers``::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 30,
     "secondary_tiers": [{"type": "PersistingTier",
                          "module_path": "persisting.integrations.vllm",
                          "storage_path": "/var/lib/persisting"}]}

Blocks live under ``<storage_path>/kv/<namespace>/`` (see ``docs/vllm.md``). The connector,
the spec and the tier import vLLM, so they are loaded on first access (vLLM looks the class
up by name); the settings, namespace and block I/O modules beside them do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from persisting.integrations.vllm.connector import PersistingConnector
    from persisting.integrations.vllm.spec import PersistingOffloadingSpec
    from persisting.integrations.vllm.tier import PersistingTier


def __getattr__(name: str) -> Any:
    if name == "PersistingConnector":
        from persisting.integrations.vllm.connector import PersistingConnector

        return PersistingConnector
    if name == "PersistingOffloadingSpec":
        from persisting.integrations.vllm.spec import PersistingOffloadingSpec

        return PersistingOffloadingSpec
    if name == "PersistingTier":
        from persisting.integrations.vllm.tier import PersistingTier

        return PersistingTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PersistingConnector", "PersistingOffloadingSpec", "PersistingTier"]
