"""Capture files pushed to disk as they are written, with a bound on the bytes still on their way there.

Why (the kernel throttling every writer on the host): docs/extraction.md, "Costs and tuning". Past the
bound the writer waits for its oldest files, so the wait lands on the writer (behind the pinned-buffer
backpressure). Linux only, through ctypes; elsewhere, or where the file system refuses the call, it does
nothing and says why in `reason`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

#: sync_file_range(2) flags (linux/fs.h)
WAIT_BEFORE, WRITE, WAIT_AFTER = 1, 2, 4
DEFAULT_LIMIT_MB = 1024

SyncFn = Callable[[int, int, int, int], int]


def libc_sync_file_range() -> SyncFn | None:
    """The C library's sync_file_range, raising OSError on failure; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def call(fd: int, offset: int, nbytes: int, flags: int) -> int:
        if fn(fd, offset, nbytes, flags) != 0:  # CDLL calls release the GIL while the kernel waits
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")
        return 0

    return call


class Writeback:
    """Files' write-out started by one flusher thread; writers block while more than `limit_bytes` of
    pushed files are not yet on the disk (0: off, the kernel decides)."""

    def __init__(self, limit_bytes: int, sync: SyncFn | None = None) -> None:
        self.limit = limit_bytes
        self._sync = sync if sync is not None else (libc_sync_file_range() if limit_bytes > 0 else None)
        self.reason = "off" if limit_bytes <= 0 else ("" if self._sync else "no sync_file_range here")
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, int]] = deque()  # (owned fd, bytes): written, write-out not started
        self._inflight: deque[tuple[int, int]] = deque()  # write-out started, oldest first
        self._inflight_bytes = 0
        self._pending = 0  # bytes pushed and not yet on the disk (queued + in flight)
        self.peak = 0  # the most pending bytes seen
        self._closed = False
        self.wait_s = 0.0  # writers blocked behind the disk
        self.waits = 0
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether files are pushed (on, and the call works here)."""
        return self._sync is not None and not self.reason

    def push(self, fd: int, size: int) -> None:
        """Hand over a written (flushed) file: its write-out starts soon; blocks while over the limit.

        Takes ownership of fd (pass a dup): it is closed once its file is on the disk, or at close().
        """
        with self._cond:
            if not self.active or self._closed:
                os.close(fd)
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._flush, name="eaglewatch-writeback", daemon=True)
                self._thread.start()
            self._queue.append((fd, size))
            self._pending += size
            self.peak = max(self.peak, self._pending)
            self._cond.notify_all()
            if self._pending <= self.limit:
                return
            t0 = time.perf_counter()
            while self._pending > self.limit and self.active and not self._closed:
                self._cond.wait()
            self.wait_s += time.perf_counter() - t0
            self.waits += 1

    def fields(self) -> dict[str, object]:
        """The capture_costs fields: writers' waits for the disk, the most bytes pending, why it was off."""
        with self._cond:
            out: dict[str, object] = {
                "writeback_wait_s": round(self.wait_s, 3),
                "writeback_waits": self.waits,
                "writeback_peak_mb": round(self.peak / 2**20, 1),
            }
            if self.reason:
                out["writeback"] = self.reason
        return out

    def close(self) -> None:
        """Start the write-out of files still queued, close every descriptor; the kernel finishes the rest."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=60)
        self._drop_all()

    def _flush(self) -> None:
        try:
            self._flush_loop()
        except BaseException as e:  # never leave a writer waiting on a flusher that is gone
            traceback.print_exc()
            with self._cond:
                self.reason = self.reason or f"the flusher stopped: {type(e).__name__}: {e}"
            self._drop_all()

    def _flush_loop(self) -> None:
        assert self._sync is not None
        while True:
            with self._cond:
                while not self._queue and not self._inflight and not self._closed and self.active:
                    self._cond.wait()
                if not self.active or (self._closed and not self._queue):
                    return
                # start new files first, unless half the bound is already in flight: then retire the oldest
                start = bool(self._queue) and (not self._inflight or self._inflight_bytes <= self.limit // 2)
                item = self._queue.popleft() if start else self._inflight.popleft()
            try:
                self._sync(item[0], 0, 0, WRITE if start else WAIT_BEFORE | WRITE | WAIT_AFTER)
            except BaseException as e:
                os.close(item[0])
                if not isinstance(e, OSError):
                    raise
                # e.g. a file system without it: the capture goes on, unpaced
                with self._cond:
                    self.reason = f"{e.strerror or e} on this file system"
                    self._pending -= item[1]
                    self._cond.notify_all()
                self._drop_all()
                return
            with self._cond:
                if start:
                    self._inflight.append(item)
                    self._inflight_bytes += item[1]
                    continue
                self._inflight_bytes -= item[1]
                self._pending -= item[1]
                self._cond.notify_all()
            os.close(item[0])

    def _drop_all(self) -> None:
        with self._cond:
            fds = [fd for fd, _ in (*self._queue, *self._inflight)]
            self._queue.clear()
            self._inflight.clear()
            self._inflight_bytes = self._pending = 0
            self._cond.notify_all()
        for fd in fds:
            os.close(fd)
