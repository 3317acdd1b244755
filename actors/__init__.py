"""Pulsing actors of Persisting: the KV-cache storage service and its event consumer.

``kv_cache_storage.KVCacheStorageActor`` serves KV stores to ``KVCacheClient``s (start it
with ``persisting serve`` or ``pulsing actor
actors.kv_cache_storage.KVCacheStorageActor ...``); ``kv_events`` applies
prewarm/evict events from a queue topic through it; ``launch`` starts them (``serve``),
runs the bounded demo (``run_demo``) and feeds the event topic (``prewarm``); ``system``
starts Pulsing with the service passphrase; ``logs`` writes the server's banner and stop
line.
"""
