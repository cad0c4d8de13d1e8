"""Device->host path: async CUDA copies into pinned buffers on a side stream, from a bounded pool."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch


class BufferPool:
    """At most `max_buffers` host buffers from `alloc`, handed out and back; `get` blocks while all are in
    use (backpressure), so host memory stays bounded however slow the disk is."""

    def __init__(
        self,
        max_buffers: int,
        alloc: Callable[[int], torch.Tensor],
        drop: Callable[[torch.Tensor], None],
        min_bytes: int = 1 << 20,
    ) -> None:
        self.max_buffers, self.min_bytes = max_buffers, min_bytes
        self._alloc, self._drop = alloc, drop
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._count = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least nbytes: a new one while under the bound, else the next one handed back."""
        with self._lock:
            if self._free.empty() and self._count < self.max_buffers:
                self._count += 1
                return self._alloc(max(nbytes, self.min_bytes))
        buf = self._free.get()  # blocks until the writer hands one back
        if buf.numel() < nbytes:  # grow: drop the small one, allocate a bigger one
            size = max(nbytes, 2 * buf.numel())
            self._drop(buf)
            buf = self._alloc(size)
        return buf

    def put(self, buf: torch.Tensor) -> None:
        """Hand a buffer back."""
        self._free.put(buf)

    def reserve(self, nbytes: int) -> None:
        """Allocate the pool up front (pinning takes long: better at start than in the middle of a step)."""
        with self._lock:
            while self._count < self.max_buffers:
                self._count += 1
                self._free.put(self._alloc(max(nbytes, self.min_bytes)))


class PinnedCopier:
    """Copy step tensors off the GPU without stalling the forward stream.

    The copy is queued on a side stream after an event recorded on the compute stream, into a pinned
    buffer of a BufferPool; the consumer waits on the returned event, reads the host view and calls release().
    """

    def __init__(
        self,
        device: torch.device,
        max_buffers: int = 6,
        min_bytes: int = 1 << 20,
        alloc: Callable[[int], torch.Tensor] | None = None,
        free: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """alloc/free: where pinned buffers come from (default: torch's pinned allocator; the writer
        process passes shared-memory ones)."""
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = BufferPool(
            max_buffers,
            alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)),
            free or (lambda buf: None),
            min_bytes,
        )
        self.waited_s = 0.0  # blocked in copy_async waiting for a buffer the writer had not handed back

    def reserve(self, nbytes: int) -> None:
        """Allocate every pinned buffer now, at setup."""
        self.pool.reserve(nbytes)

    def copy_async(
        self, *tensors: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.cuda.Event, Callable[[], None], tuple[torch.cuda.Event, ...]]:
        """Start copying tensors (current stream's work) to one pinned buffer.

        Returns (host views, done event, release, (ready, copy_start, done)): the last three are timing
        events (the compute stream's work up to here, the copy's start and end on the side stream).
        """
        sizes = [t.numel() * t.element_size() for t in tensors]
        starts, total = [], 0
        for n in sizes:
            starts.append(total)
            total += n + (-n % 64)  # keep every view aligned
        t0 = time.perf_counter()
        buf = self.pool.get(total)
        self.waited_s += time.perf_counter() - t0
        ready = torch.cuda.Event(enable_timing=True)
        ready.record(torch.cuda.current_stream(self.device))
        hosts = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            began = torch.cuda.Event(enable_timing=True)
            began.record(self.stream)
            for t, at, n in zip(tensors, starts, sizes, strict=True):
                host = buf[at : at + n].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
                hosts.append(host)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        for t in tensors:
            t.record_stream(self.stream)  # keep the allocator from reusing t before the copy ran
        return hosts, done, lambda: self.pool.put(buf), (ready, began, done)
