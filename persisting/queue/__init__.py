"""The durable Lance queue backend for Pulsing's ``pulsing.streaming`` queues.

::

    from persisting.queue import LanceBackend
    from pulsing.streaming import register_backend
    register_backend("lance", LanceBackend)       # or: persisting.queue.register()

Records live at ``<storage_path>/queue/<topic>/bucket_<id>/data.lance`` as typed columns with
stable offsets; see ``docs/queue.md``.
"""

from persisting.queue.api import (
    BACKEND_NAMES,
    QueueConsumer,
    TopicReader,
    open_bucket,
    open_reader,
    open_writer,
    register,
    topic_storage_path,
)
from persisting.queue.backend import LanceBackend, TensorPutResult, close_all
from persisting.queue.maintenance import compact_bucket

__all__ = [
    "BACKEND_NAMES",
    "LanceBackend",
    "QueueConsumer",
    "TensorPutResult",
    "TopicReader",
    "close_all",
    "compact_bucket",
    "open_bucket",
    "open_reader",
    "open_writer",
    "register",
    "topic_storage_path",
]
