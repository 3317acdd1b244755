"""The client of the KV-cache service: ``KVCacheClient`` and ``SyncKVCacheClient``.

How it works:

* **Placement** (:mod:`.cluster`): every storage actor registered under ``name`` is a
  member; each key goes to one member by rendezvous hashing. A member that fails a request
  is left out until a probe reaches it again: its keys are misses (recompute) and its puts
  go to the next member in the key's ranking. Nothing is replicated.
* **Control** (:mod:`.transport`): Pulsing asks, at most ``max_inflight`` (<= 16,
  Pulsing's connection pool) in flight per member; timeouts; a lost session is re-opened
  transparently.
* **Values** (:mod:`.link`, :mod:`.reads`, :mod:`.writes`): on data connections to the
  member's data path (its Unix socket on the same host, else TCP, TLS off loopback), in
  one stream protocol; on the same host, memory-tier values whose place is known are
  copied straight out of the server's shared pool.
* **Errors** come back as the same :mod:`persisting.errors` types the store raises.
* **Sessions**: pins and read leases belong to the client's session on each member; the
  client renews it every ``lease_ttl_s / 3`` seconds, so a crashed client's pins expire.
"""

from persisting.service.client.kv_cache_client import KVCacheClient, PutResult
from persisting.service.client.sync import SyncKVCacheClient, connect_sync

__all__ = ["KVCacheClient", "PutResult", "SyncKVCacheClient", "connect_sync"]
