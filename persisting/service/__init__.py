"""The KV-cache service: wire protocol, client, placement and session bookkeeping.

``from persisting.service import KVCacheClient`` gives the client of the
``KVCacheStorageActor`` service (``actors/kv_cache_storage.py``). The protocol, routing,
session and same-host modules do not import Pulsing; only the client does.
"""

from persisting.service.client import KVCacheClient, PutResult
from persisting.service.protocol import PROTOCOL_VERSION
from persisting.service.sync_client import SyncKVCacheClient

__all__ = ["PROTOCOL_VERSION", "KVCacheClient", "PutResult", "SyncKVCacheClient"]
