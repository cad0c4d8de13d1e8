"""Follow files by byte offset: inotify (via ctypes) wakes the daemon; a 0.2 s sleep-poll is the fallback."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
#: What a watched run or output directory reports: writes, new files, renames into it.
DIR_MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_ATTRIB
#: Sleep between looks when inotify is not available.
POLL_INTERVAL_S = 0.2

_EVENT = struct.Struct("iIII")


class Inotify:
    """One inotify descriptor hooked into the event loop; calls ``callback(key)`` for the watch that fired."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if not sys.platform.startswith("linux"):
            raise OSError(errno.ENOSYS, "inotify needs Linux")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._add.restype = ctypes.c_int
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        self._rm.restype = ctypes.c_int
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd
        self._loop = loop
        self._by_wd: dict[int, set[str]] = {}
        self._wd_by_key: dict[str, int] = {}
        self._callbacks: dict[str, Callable[[], None]] = {}
        loop.add_reader(fd, self._on_readable)

    def watch(self, key: str, directory: Path, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever ``directory`` changes (replaces an earlier watch of ``key``)."""
        self.unwatch(key)
        wd = self._add(self.fd, os.fsencode(directory), DIR_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch {directory}: {os.strerror(err)}")
        self._by_wd.setdefault(wd, set()).add(key)
        self._wd_by_key[key] = wd
        self._callbacks[key] = callback

    def unwatch(self, key: str) -> None:
        """Stop calling back for ``key``."""
        wd = self._wd_by_key.pop(key, None)
        self._callbacks.pop(key, None)
        if wd is None:
            return
        keys = self._by_wd.get(wd, set())
        keys.discard(key)
        if not keys:
            self._by_wd.pop(wd, None)
            self._rm(self.fd, wd)

    def _on_readable(self) -> None:
        fired: set[str] = set()
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # BlockingIOError: nothing more to read
                break
            pos = 0
            while pos + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, pos)
                pos += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    fired.update(self._callbacks)  # events were dropped: wake everyone
                else:
                    fired.update(self._by_wd.get(wd, ()))
            if len(data) < 4096:
                break
        for key in fired:
            if (cb := self._callbacks.get(key)) is not None:
                cb()

    def close(self) -> None:
        """Stop watching and close the descriptor."""
        if self.fd >= 0:
            self._loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1


class Pulse:
    """A level-triggered wake-up: ``notify()`` from the loop, ``await wait(timeout)`` in one task."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Wake the waiter (remembered if nobody waits right now)."""
        self._event.set()

    async def wait(self, timeout: float | None) -> bool:
        """Wait for a notification or the timeout; True when notified."""
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel in 3.11
                await self._event.wait()
        except TimeoutError:
            return False
        self._event.clear()
        return True


class Broadcast:
    """Many waiters, each woken by every ``notify()`` after it read ``generation`` (so none is missed)."""

    def __init__(self) -> None:
        self.generation = 0
        self._fut: asyncio.Future[None] | None = None

    def notify(self) -> None:
        """Bump the generation and wake every waiter (call from the event loop)."""
        self.generation += 1
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait_past(self, generation: int, timeout: float | None) -> int:
        """Wait until the generation moves past ``generation`` (or the timeout); return the current one."""
        if self.generation != generation:
            return self.generation
        if self._fut is None:
            self._fut = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._fut)
        return self.generation


@dataclass
class ReadResult:
    """Bytes read from a followed file; ``reset`` when the file shrank (truncated or replaced)."""

    data: bytes
    offset: int
    reset: bool
    size: int


def read_from(path: Path, offset: int, max_bytes: int) -> ReadResult:
    """Read up to ``max_bytes`` from ``offset``; start again at 0 when the file is shorter than ``offset``."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            reset = size < offset
            if reset:
                offset = 0
            fh.seek(offset)
            data = fh.read(max(0, min(max_bytes, size - offset)))
    except FileNotFoundError:
        return ReadResult(b"", offset, False, 0)
    return ReadResult(data, offset, reset, size)
