"""The KV-cache service: wire protocol, client, server handler, placement and sessions.

``from persisting.service import KVCacheClient`` gives the client of the
``KVCacheStorageActor`` service (:mod:`actors.kv_cache_storage`). The protocol,
handler, routing, session and same-host modules do not import Pulsing; only the client does.
"""

from persisting.service.client import KVCacheClient, PutResult, SyncKVCacheClient, connect_sync
from persisting.service.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "KVCacheClient", "PutResult", "SyncKVCacheClient", "connect_sync"]
