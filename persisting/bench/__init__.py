"""Trace-replay benchmark: synthetic traces, replay against a KV target, reports and plots.

``trace`` (format and generator), ``replay`` (drives a :class:`~persisting.bench.replay.Target`),
``report`` (hit rates, bytes, percentiles), ``plot`` (PNG), ``targets`` (a local store).
Used by ``persisting bench``; it sits beside the actors, above ``persisting.kv``.
"""
