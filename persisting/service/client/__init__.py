"""The client of the KV-cache service: ``KVCacheClient`` and ``SyncKVCacheClient``.

How it works:

* **Placement** (:mod:`.cluster`): every storage actor registered under ``name`` is a
  member; each key goes to one member by rendezvous hashing. A member that fails a request
  is left out until a probe reaches it again: its keys are misses (recompute) and its puts
  go to the next member in the key's ranking. Nothing is replicated.
* **Transport** (:mod:`.transport`): at most ``max_inflight`` (<= 16, Pulsing's connection
  pool) requests in flight per member, over the member's Unix socket on the same host or
  spread over its lanes (actors sharing its stores) otherwise; timeouts; a lost session is
  re-opened transparently.
* **Reads** (:mod:`.reads`, :mod:`.sources`) and **writes** (:mod:`.writes`): on the same
  host, memory-tier values are copied by the client straight out of the server's shared
  pool, disk values are read by the client from their payload files under a read lease,
  and puts go through the client's shared-memory arena, whose regions are lent to the
  server per request (:mod:`.regions`). Other clients use messages.
* **Errors** come back as the same :mod:`persisting.errors` types the store raises.
* **Sessions**: pins and read leases belong to the client's session on each member; the
  client renews it every ``lease_ttl_s / 3`` seconds, so a crashed client's pins expire.
"""

from persisting.service.client.kv_cache_client import KVCacheClient, PutResult
from persisting.service.client.sync import SyncKVCacheClient, connect_sync

__all__ = ["KVCacheClient", "PutResult", "SyncKVCacheClient", "connect_sync"]
