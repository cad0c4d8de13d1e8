"""A helper child process on two pipes (the encoder stage, the classifier child): start, frames, reaping.

Frames both ways: an 8-byte little-endian length, then the payload; a reply's length has its top bit set
when the child failed the request (the payload is the error text).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import subprocess
import sys
import threading

HEAD = struct.Struct("<Q")
FAILED = 1 << 63
#: Pipe size asked for both ways: a large batch is written without waiting for the child to read it.
PIPE_BYTES = 1 << 20
REAP_S = 2.0  # how long a closed child may take to exit before it is killed
#: ``auto`` turns a helper child on where the daemon may run on this many CPUs or more.
MIN_CPUS = 4


def cpus() -> int:
    """How many CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def wanted(env: str, default: str = "off", min_cpus: int = MIN_CPUS) -> bool:
    """Whether the helper child that ``env`` switches is wanted: ``on``, ``off`` or ``auto`` (on with
    ``min_cpus`` or more), ``default`` where unset; ValueError naming ``env`` for anything else."""
    mode = os.environ.get(env, default)
    if mode not in ("on", "off", "auto"):
        raise ValueError(f"{env} must be on, off or auto, not {mode!r}")
    return mode == "on" or (mode == "auto" and cpus() >= min_cpus)


def spawn(module: str) -> subprocess.Popen[bytes]:
    """``python -m module`` on two pipes, with this process's import path."""
    return subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        close_fds=True,
    )


def pipe_ends(proc: subprocess.Popen[bytes]) -> tuple[int, int, int]:
    """The child's input and output descriptors, both grown to PIPE_BYTES where allowed, the output made
    non-blocking; and the smaller pipe's size."""
    assert proc.stdin is not None and proc.stdout is not None
    out, inp = proc.stdin.fileno(), proc.stdout.fileno()
    size = PIPE_BYTES
    for fd in (out, inp):
        with contextlib.suppress(OSError):  # a lower pipe-max-size: the pipe keeps what it has
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        size = min(size, fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
    os.set_blocking(inp, False)
    return out, inp, size


def read_exact(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd`` (blocking), or fewer at end of file."""
    parts: list[bytes] = []
    while n > 0:
        chunk = os.read(fd, n)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def write_all(fd: int, *parts: bytes) -> None:
    """Write ``parts`` to ``fd`` one after another (blocking), from where they lie (one writev, no join)."""
    views = [memoryview(p) for p in parts if p]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def write_frame(fd: int, payload: bytes, failed: bool = False, *, op: bytes = b"") -> None:
    """One frame: its length (top bit set when ``failed``), then ``op`` and ``payload`` (a block of log
    lines goes out as it lies: not copied into a frame)."""
    write_all(fd, HEAD.pack((len(op) + len(payload)) | (FAILED if failed else 0)) + op, payload)


def take_frame(buf: bytearray) -> tuple[bool, bytes] | None:
    """The first whole frame in ``buf`` as (failed, payload), removed from it; None while it is partial."""
    if len(buf) < HEAD.size:
        return None
    (head,) = HEAD.unpack_from(buf)
    n = head & ~FAILED
    if len(buf) < HEAD.size + n:
        return None
    payload = bytes(buf[HEAD.size : HEAD.size + n])
    del buf[: HEAD.size + n]
    return bool(head & FAILED), payload


def close(proc: subprocess.Popen[bytes]) -> None:
    """Close the child's input (it exits then) without waiting for it on this thread: one still running is
    reaped on a thread (killed after ``REAP_S``)."""
    with contextlib.suppress(OSError):
        proc.stdin.close()  # type: ignore[union-attr]
    if proc.poll() is None:
        threading.Thread(target=reap, args=(proc,), name="child-reap", daemon=True).start()
    else:
        reap(proc)


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a child whose input is closed (kill it after ``REAP_S``), then close its output: only now,
    so that a reply it is still writing does not end it with a broken pipe."""
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError):
        proc.stdout.close()  # type: ignore[union-attr]
