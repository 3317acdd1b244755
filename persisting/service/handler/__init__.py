"""The server side of the control protocol: :class:`StorageHandler`.

``dispatch`` checks requests and owns sessions; ``index_ops`` implements the index
operations; ``placements`` is the feed of recent pool placements; ``common`` is what they
and the data path share.
"""

from persisting.service.handler.dispatch import StorageHandler

__all__ = ["StorageHandler"]
