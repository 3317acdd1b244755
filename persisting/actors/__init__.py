"""Pulsing actors of Persisting: the KV-cache storage service and its event consumer.

``persisting.actors.kv_cache_storage.KVCacheStorageActor`` serves KV stores to ``KVCacheClient``s;
``persisting.actors.kv_events`` applies prewarm/evict events from a queue topic through it;
``persisting.actors.launch`` starts them (``serve``), runs the bounded demo (``run_demo``) and feeds
the event topic (``prewarm``).
"""
