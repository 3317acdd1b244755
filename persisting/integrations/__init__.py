"""Bridges between Persisting's KV store and model libraries and serving engines.

* :mod:`.common`: the engine-adapter layer every engine runs on: the shared settings
  (``storage_path`` or ``cluster``, sizes with units, the namespace's parts), one namespace
  and key builder, one opener returning a local root or a cluster behind one interface
  (batched ``read_into`` / ``write_from`` between the store and the engine's memory).
* :mod:`.vllm` (vLLM's offloading connector and ``PersistingTier``), :mod:`.sglang`
  (SGLang's HiCache L3 backend), :mod:`.lmcache` (LMCache's storage plugin and L2 adapter;
  ``persisting.lmcache`` and ``persisting.lmcache_backend`` re-export it).
* :mod:`.transformers` (extra ``hf``): save and restore a transformers ``DynamicCache``
  prefix.

Only the command line imports anything here from the rest of Persisting.
"""
