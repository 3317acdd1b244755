"""The server side of the protocol: :class:`StorageHandler` and its request paths.

``dispatch`` checks requests and owns sessions; ``puts``, ``gets`` and ``index_ops``
implement the operations; ``common`` is what they share.
"""

from persisting.service.handler.common import DEFAULT_MESSAGE_PART_BYTES
from persisting.service.handler.dispatch import StorageHandler

__all__ = ["DEFAULT_MESSAGE_PART_BYTES", "StorageHandler"]
