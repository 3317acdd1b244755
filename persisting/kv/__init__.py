"""The KV-cache store: LMCache-compatible keys, tensor values, memory and disk tiers.

Nothing here imports Pulsing, the service, the plugin or the CLI.
"""

from persisting.kv.api import AsyncKVApi, KVApi
from persisting.kv.disk.leases import Location
from persisting.kv.eviction.policy import (
    AdmissionPolicy,
    EvictionPolicy,
    LRUEviction,
    PrefixAwareEviction,
    SecondSightingAdmit,
)
from persisting.kv.keys import ChunkKey, LayerChunkKey, TokenHasher, key_string, parse_key
from persisting.kv.layout import MEMORY_FORMATS, Gathered, Layout
from persisting.kv.store import KVStore, PutResult, SharedLocation, Tier, open_kv_store

__all__ = [
    "MEMORY_FORMATS",
    "AdmissionPolicy",
    "AsyncKVApi",
    "ChunkKey",
    "EvictionPolicy",
    "Gathered",
    "KVApi",
    "KVStore",
    "LRUEviction",
    "LayerChunkKey",
    "Layout",
    "Location",
    "PrefixAwareEviction",
    "PutResult",
    "SecondSightingAdmit",
    "SharedLocation",
    "Tier",
    "TokenHasher",
    "key_string",
    "open_kv_store",
    "parse_key",
]
