"""Persisting: a persistent, tiered KV-cache store and a durable Lance queue for LLM serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("persisting")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
