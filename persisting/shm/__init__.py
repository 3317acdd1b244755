"""Memory shared between threads and processes on one host.

``pages``: the page size, aligned buffers, the page allocator every fast path carves its
ranges from, and the bulk copy. ``files``: ``/dev/shm`` files two processes map, and the
liveness check that finds orphaned ones. ``pool``: the memory tier's shared pool and its
seqlock reader. Nothing here knows about KV caches or the service.
"""

from persisting.shm.files import (
    DEFAULT_SHM_DIR,
    create_shm_file,
    open_shm_file,
    pid_alive,
    remove_orphaned_files,
    shm_available,
)
from persisting.shm.pages import (
    PAGE,
    PageAllocator,
    RecycledBuffers,
    aligned_buffer,
    copy_bytes,
    copy_into,
    loaded_torch,
    owning_array,
    pages_resident,
    populate,
    round_to_page,
)
from persisting.shm.pool import POOL_PREFIX, SharedPool, SharedPoolReader, seqlock_safe

__all__ = [
    "DEFAULT_SHM_DIR",
    "PAGE",
    "POOL_PREFIX",
    "PageAllocator",
    "RecycledBuffers",
    "SharedPool",
    "SharedPoolReader",
    "aligned_buffer",
    "copy_bytes",
    "copy_into",
    "create_shm_file",
    "loaded_torch",
    "open_shm_file",
    "owning_array",
    "pages_resident",
    "pid_alive",
    "populate",
    "remove_orphaned_files",
    "round_to_page",
    "seqlock_safe",
    "shm_available",
]
