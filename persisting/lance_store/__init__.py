"""The shared Lance layer under both the queue and the KV store.

It knows storage roots, path layout, file modes, namespace locks, datasets, blobs and
durability, and nothing about queues or KV caches.
"""

from persisting.lance_store.access import GROUP_READ, OWNER_ONLY, FileModes, file_modes
from persisting.lance_store.blobs import blob_field, blob_references
from persisting.lance_store.durable import fsync_dir, fsync_file
from persisting.lance_store.names import decode_name, encode_name, validate_name
from persisting.lance_store.root import StorageRoot
from persisting.lance_store.table import LanceTable, disk_usage

__all__ = [
    "GROUP_READ",
    "OWNER_ONLY",
    "FileModes",
    "LanceTable",
    "StorageRoot",
    "blob_field",
    "blob_references",
    "decode_name",
    "disk_usage",
    "encode_name",
    "file_modes",
    "fsync_dir",
    "fsync_file",
    "validate_name",
]
