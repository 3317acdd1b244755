"""Bridges between Persisting's KV store and model libraries (optional extras).

``persisting.integrations.transformers`` (extra ``hf``): save and restore a transformers
``DynamicCache`` prefix. Nothing here is imported by the rest of Persisting.
"""
