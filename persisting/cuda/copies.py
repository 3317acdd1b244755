"""Copies between host memory and a device on a side stream, and the staging ring.

Part of :mod:`persisting.cuda` (see its docstring for the ordering and lifetime rules).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from persisting.cuda.pinned import PinnedRegion, cuda_available, open_region
from persisting.errors import InvalidValueError
from persisting.shm import aligned_buffer


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _host_tensor(source: Any) -> Any:
    """A flat uint8 CPU tensor over ``source`` (an array or a CPU tensor), no copy."""
    import torch

    if isinstance(source, torch.Tensor):
        if source.device.type != "cpu" or not source.is_contiguous():
            raise InvalidValueError("host sources must be contiguous CPU tensors or arrays")
        return source.reshape(-1).view(torch.uint8)
    array = np.asarray(source).reshape(-1).view(np.uint8)
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():  # read-only (a read-only pool mapping): we only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class _Done:
    """The event of a copy that completed when it was issued (host lane)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostLane:
    """Copies into and out of CPU tensors: each one is done when issued."""

    def begin(self) -> None:
        pass

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def keep(self, tensor: Any) -> None:
        pass

    def mark(self) -> Any:
        return _Done()

    def publish(self, event: Any) -> None:
        pass


class _CudaLane:
    """A side stream of one device, ordered against the caller's current stream."""

    def __init__(self, device: Any):
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def begin(self) -> None:
        """Copies issued after this see everything the caller queued before (the tensors
        it produced, and its last uses of the memory we are about to overwrite)."""
        self.stream.wait_stream(self._torch.cuda.current_stream(self.device))

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return self._torch.cuda.stream(self.stream)

    def keep(self, tensor: Any) -> None:
        """A caller's device tensor is used on the side stream: its memory must not be
        reused (by torch's caching allocator) before the side stream is done with it."""
        tensor.record_stream(self.stream)

    def mark(self) -> Any:
        event = self._torch.cuda.Event()
        event.record(self.stream)
        return event

    def publish(self, event: Any) -> None:
        """Work the caller queues from now on runs after the copies (no host wait)."""
        self._torch.cuda.current_stream(self.device).wait_event(event)


class DeviceCopier:
    """Host<->device copies for one device (``cuda[:i]``, or ``cpu``), through ``staging``.

    Thread-safe. Host buffers come from ``staging`` (pinned where CUDA is) while it has
    room, else from pageable memory (counted in :attr:`counters`; slower, still correct).
    """

    def __init__(self, device: Any = "cuda", *, staging: PinnedRegion | None = None):
        import torch

        self.device = torch.device(device)
        self._lane: _HostLane | _CudaLane
        if self.device.type == "cuda":
            if not cuda_available():
                raise InvalidValueError(f"device {self.device} needs CUDA, which is absent here")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._lane = _CudaLane(self.device)
        elif self.device.type == "cpu":
            self._lane = _HostLane()
        else:
            raise InvalidValueError(f"unsupported device {self.device} (cuda or cpu)")
        self.staging = staging
        #: Copies not known to be complete: (event, what must outlive the copy).
        self._inflight: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()
        self._lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()

    # -- bookkeeping ----------------------------------------------------------------------

    def _count(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.counters[name] += nbytes

    def _track(self, event: Any, *keep: Any) -> None:
        with self._lock:
            self._inflight.append((event, keep))

    def _reap(self) -> None:
        """Drop what completed copies held (their staging ranges go back)."""
        with self._lock:
            while self._inflight and self._inflight[0][0].query():
                self._inflight.popleft()

    def _wait_oldest(self) -> bool:
        """Wait for the oldest copy in flight and drop what it held; False if none."""
        with self._lock:
            if not self._inflight:
                return False
            event, _keep = self._inflight.popleft()
        event.synchronize()
        return True

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A staging buffer for the caller to fill and hand to :meth:`to_device` (which keeps
        it until its copy ran): waits for copies in flight when the region is full."""
        return self._host_buffer(nbytes)

    def _host_buffer(self, nbytes: int) -> np.ndarray:
        """Staging room for ``nbytes``, waiting for copies in flight to give some back;
        pageable memory when the value is larger than the staging region, or it is held."""
        if self.staging is not None and nbytes <= self.staging.capacity:
            while True:
                buffer = self.staging.allocate(nbytes)
                if buffer is not None:
                    self._count("staged_bytes", nbytes)
                    return buffer
                if not self._wait_oldest():
                    break
        self._count("pageable_bytes", nbytes)
        return aligned_buffer(nbytes)

    def _check_device(self, tensor: Any) -> None:
        if tensor.device != self.device:
            raise InvalidValueError(f"tensor on {tensor.device}, copier for {self.device}")

    # -- host to device -----------------------------------------------------------------

    def _copy_up(self, source: Any, out: Any) -> Any:
        """Issue the copy of the host bytes ``source`` into ``out``; returns its event."""
        import torch

        host = _host_tensor(source)
        if host.numel() != _nbytes(out):
            raise InvalidValueError(f"{host.numel()} bytes cannot fill a {_nbytes(out)}-byte out")
        self._lane.keep(out)
        with self._lane.context():
            if out.is_contiguous():
                out.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
                temp = None
            else:  # land contiguous on the device, then scatter there
                temp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
                temp.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
                out.copy_(temp)
        event = self._lane.mark()
        self._track(event, source, host, temp)
        return event

    def to_device(self, sources: Sequence[Any], outs: Sequence[Any]) -> None:
        """Copy each host buffer (array or CPU tensor: its bytes) into the device tensor of
        the same byte size. Returns once issued: work the caller queues on its current
        stream afterwards sees the data; the sources are kept alive until copied."""
        if len(sources) != len(outs):
            raise InvalidValueError(f"{len(sources)} sources but {len(outs)} outs")
        for out in outs:
            self._check_device(out)
        self._reap()
        self._lane.begin()
        last = None
        try:
            for source, out in zip(sources, outs, strict=True):
                last = self._copy_up(source, out)
                self._count("h2d_bytes", _nbytes(out))
        finally:  # even when a later item fails, what was issued is ordered before the caller
            if last is not None:
                self._lane.publish(last)

    def upload(
        self, reads: Sequence[Callable[[np.ndarray], bool]], outs: Sequence[Any]
    ) -> list[bool]:
        """For each i, ``reads[i](buffer)`` fills a staging buffer of ``outs[i]``'s byte size
        and returns whether it could (False: a miss or damage); the buffer then goes up to
        ``outs[i]`` while ``reads[i+1]`` runs. ``outs[i]`` is written only when its read
        succeeded. Returns once the copies are issued, ordered before the caller's later
        work as in :meth:`to_device`."""
        if len(reads) != len(outs):
            raise InvalidValueError(f"{len(reads)} reads but {len(outs)} outs")
        for out in outs:
            self._check_device(out)
        self._reap()
        self._lane.begin()
        done: list[bool] = []
        last = None
        try:
            for read, out in zip(reads, outs, strict=True):
                nbytes = _nbytes(out)
                buffer = self._host_buffer(nbytes)
                if not read(buffer):
                    done.append(False)
                    continue
                last = self._copy_up(buffer, out)
                self._count("h2d_bytes", nbytes)
                done.append(True)
        finally:  # a read that raises still leaves the issued copies ordered before the caller
            if last is not None:
                self._lane.publish(last)
        return done

    # -- device to host -----------------------------------------------------------------

    def _copy_down(self, tensor: Any, buffer: np.ndarray) -> Any:
        import torch

        self._lane.keep(tensor)
        with self._lane.context():
            source = tensor.detach()
            if not source.is_contiguous():
                source = source.contiguous()  # on the device, in the side stream
            host = torch.from_numpy(buffer)
            host.copy_(source.reshape(-1).view(torch.uint8), non_blocking=True)
        return self._lane.mark(), source

    def to_host(
        self,
        tensors: Iterable[Any],
        allocate: Callable[[int], np.ndarray | None] | None = None,
    ) -> Iterator[np.ndarray]:
        """Each tensor's bytes in a host uint8 array, yielded in order as each lands; the
        copies of later tensors run while the caller works on earlier ones.

        Buffers come from ``allocate(nbytes)`` (default: the staging region); when it has
        no room, the earliest copies are handed over first so the caller can free them,
        and only when none is left in flight does a copy land in pageable memory.
        Non-contiguous tensors are made contiguous on the device.
        """
        allocate = allocate or (self.staging.allocate if self.staging is not None else None)
        pending: collections.deque[tuple[Any, np.ndarray, Any]] = collections.deque()
        try:
            for tensor in tensors:
                self._check_device(tensor)
                # Per tensor: a lazy iterable may have just queued the work producing it.
                self._lane.begin()
                nbytes = _nbytes(tensor)
                buffer = allocate(nbytes) if allocate is not None else None
                while buffer is None and pending:
                    yield self._landed(pending.popleft())
                    buffer = allocate(nbytes) if allocate is not None else None
                if buffer is None:
                    self._count("pageable_bytes", nbytes)
                    buffer = aligned_buffer(nbytes)
                event, source = self._copy_down(tensor, buffer)
                pending.append((event, buffer, source))
            while pending:
                yield self._landed(pending.popleft())
        finally:
            # Abandoned midway: never let a buffer go back while a copy still writes it.
            for event, _buffer, _source in pending:
                event.synchronize()

    def _landed(self, entry: tuple[Any, np.ndarray, Any]) -> np.ndarray:
        event, buffer, _source = entry
        event.synchronize()
        self._count("d2h_bytes", buffer.nbytes)
        return buffer

    # -- lifecycle ------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every copy this copier issued."""
        while self._wait_oldest():
            pass

    def close(self) -> None:
        """Wait for the copies in flight, then release the staging region."""
        self.synchronize()
        if self.staging is not None:
            self.staging.close()


#: A staging region of this size serves one chunk of a 32B-class model (64 MiB) four deep.
DEFAULT_STAGING_BYTES = 256 << 20

_shared: dict[tuple[str, str, int], DeviceCopier] = {}
_shared_lock = threading.Lock()


def shared_copier(
    device: Any = "cuda", *, pinned_memory: str = "auto", staging_bytes: int = DEFAULT_STAGING_BYTES
) -> DeviceCopier:
    """One copier per device and setting for the whole process (pinning is costly to set
    up, so it is done once), made on first use."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and cuda_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (str(dev), pinned_memory, staging_bytes)
    with _shared_lock:
        copier = _shared.get(key)
        if copier is None:
            mode = pinned_memory if dev.type == "cuda" else "off"
            copier = DeviceCopier(dev, staging=open_region(staging_bytes, mode))
            _shared[key] = copier
        return copier
