"""The shared Lance layer under both the queue and the KV store.

It knows storage roots, path layout, datasets, blobs and durability, and nothing about
queues or KV caches.
"""

from persisting.lance_store.blobs import blob_field, blob_references
from persisting.lance_store.durable import fsync_dir, fsync_file
from persisting.lance_store.files import pid_alive, read_file_range
from persisting.lance_store.names import decode_name, encode_name, validate_name
from persisting.lance_store.store import LanceStore
from persisting.lance_store.table import LanceTable, disk_usage

__all__ = [
    "LanceStore",
    "LanceTable",
    "blob_field",
    "blob_references",
    "decode_name",
    "disk_usage",
    "encode_name",
    "fsync_dir",
    "fsync_file",
    "pid_alive",
    "read_file_range",
    "validate_name",
]
