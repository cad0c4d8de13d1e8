"""Capture files pushed to disk as they are written, with a bound on the bytes still on their way there.

Left to itself the kernel keeps every written file in the page cache until its dirty thresholds are
crossed, and then throttles *every* process on the host that writes a byte: the job's log lines, its
manifest, the agent's journal. On the H200 that stalled the job 1.6–3.4 s at the end of a 17 GB capture
while the file writers themselves were not slowed. sync_file_range(2) starts each file's write-out at
once; when more than the bound is in flight the writer waits for its oldest files, so the wait lands on
the writer (where the pinned-buffer backpressure already handles it) and never on the rest of the host.
Linux only, through ctypes (stdlib); elsewhere, or where the file system refuses the call, it does nothing
and says why in `reason`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
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
    """Starts each written file's write-out; keeps at most `limit_bytes` of them in flight (0: off)."""

    def __init__(self, limit_bytes: int, sync: SyncFn | None = None) -> None:
        self.limit = limit_bytes
        self._sync = sync if sync is not None else (libc_sync_file_range() if limit_bytes > 0 else None)
        self.reason = "off" if limit_bytes <= 0 else ("" if self._sync else "no sync_file_range here")
        self._lock = threading.Lock()
        self._inflight: deque[tuple[int, int]] = deque()  # (owned fd, bytes), oldest first
        self._bytes = 0
        self.wait_s = 0.0  # writers waiting for older files to reach the disk
        self.waits = 0

    @property
    def active(self) -> bool:
        """Whether files are pushed (on, and the call works here)."""
        return self._sync is not None and not self.reason

    def push(self, fd: int, size: int) -> None:
        """Start writing out fd's file (flushed already); wait for the oldest while over the limit.

        Takes ownership of fd (pass a dup): it is closed once its file is on the disk or at close().
        """
        if not self.active:
            os.close(fd)
            return
        assert self._sync is not None
        try:
            self._sync(fd, 0, 0, WRITE)
        except OSError as e:  # e.g. a file system without it: the capture goes on, unpaced
            os.close(fd)
            self._give_up(f"{e.strerror or e} on this file system")
            return
        with self._lock:
            self._inflight.append((fd, size))
            self._bytes += size
        while True:
            with self._lock:
                if self._bytes <= self.limit or not self._inflight:
                    return
                old, n = self._inflight.popleft()
                self._bytes -= n
            t0 = time.perf_counter()
            try:
                self._sync(old, 0, 0, WAIT_BEFORE | WRITE | WAIT_AFTER)
            except OSError as e:
                self._give_up(f"{e.strerror or e} while waiting")
            finally:
                os.close(old)
            with self._lock:
                self.wait_s += time.perf_counter() - t0
                self.waits += 1

    def fields(self) -> dict[str, object]:
        """The capture_costs fields: how long writers waited for the disk, and whether pacing ran."""
        with self._lock:
            out: dict[str, object] = {"writeback_wait_s": round(self.wait_s, 3)}
            out["writeback_waits"] = self.waits
        if self.reason:
            out["writeback"] = self.reason
        return out

    def close(self) -> None:
        """Forget the files in flight (the kernel finishes writing them) and close their descriptors."""
        with self._lock:
            fds, self._inflight, self._bytes = [fd for fd, _ in self._inflight], deque(), 0
        for fd in fds:
            os.close(fd)

    def _give_up(self, why: str) -> None:
        with self._lock:
            self.reason = why
            fds, self._inflight, self._bytes = [fd for fd, _ in self._inflight], deque(), 0
        for fd in fds:
            os.close(fd)
