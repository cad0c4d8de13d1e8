"""The journal's encoder stage: a child process that turns batches of events into journal lines.

While the daemon catches up on a backlog, JSON-encoding its events (~12 µs each, a third of the rules'
time) runs here, on another core, while the daemon reads and classifies the next chunk: a thread would
not help, as the encoder holds the GIL.  Events go in ``marshal``-ed (~1.4 µs each: the same dicts,
lists, strings and floats, bit for bit) and come back as the lines ``jsonline.encode_lines`` makes; the
child never touches the journal file, so a daemon killed mid-batch leaves nothing half-owned behind.

Frames both ways: an 8-byte little-endian length, then the payload; a reply's length has its top bit set
when encoding failed (the payload is the error text).  The child writes ``R`` once it is ready.
"""

from __future__ import annotations

import contextlib
import fcntl
import marshal
import os
import struct
import subprocess
import sys
import threading
from collections import deque
from typing import Any

_HEAD = struct.Struct("<Q")
_FAILED = 1 << 63
_READY = b"R"
#: Pipe size asked for both ways: a large batch is written without waiting for the child to read it.
PIPE_BYTES = 1 << 20


#: ``on``, ``off`` (the default) or ``auto``: on where the daemon may run on MIN_CPUS CPUs or more.  With
#: fewer, the child takes its CPU time from the daemon's own core (measured on a 2-vCPU VM: slower).  Off
#: by default: each watched run would start a child, and on a 16-core H200 host a real daemon gained little
#: from it (tests/bench/bench_daemon_ingest.py: 0.69 of the pure loop's speed with it, 0.64 without; the
#: daemon's own CPU barely fell, since sending the batches and writing their lines back cost about what
#: encoding them did).
ENCODER_ENV = "EAGLEWATCH_AGENT_ENCODER"
MIN_CPUS = 4
REAP_S = 2.0  # how long a closed stage may take to exit before it is killed


def stage_wanted() -> bool:
    """Whether journals use an encoder stage for backlogs (``EAGLEWATCH_AGENT_ENCODER``; ValueError when
    it is set to something else than on, off or auto)."""
    mode = os.environ.get(ENCODER_ENV, "off")
    if mode not in ("on", "off", "auto"):
        raise ValueError(f"{ENCODER_ENV} must be on, off or auto, not {mode!r}")
    return mode == "on" or (mode == "auto" and len(os.sched_getaffinity(0)) >= MIN_CPUS)


class StageError(Exception):
    """The encoder stage cannot take or return a batch (it died, or its pipe broke); the text says why."""


def _read_exact(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd`` (blocking), or fewer at end of file."""
    parts: list[bytes] = []
    while n > 0:
        chunk = os.read(fd, n)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (blocking)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class EncoderStage:
    """The daemon's end of one encoder child: batches go out in order and their lines come back in order."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "agent.runs.encoder"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            close_fds=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out = self._proc.stdin.fileno()
        self._in = self._proc.stdout.fileno()
        size = PIPE_BYTES
        for fd in (self._out, self._in):
            with contextlib.suppress(OSError):  # a lower pipe-max-size: the pipe keeps what it has
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            size = min(size, fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
        # The daemon never blocks on the child: it reads replies only when they are there (its end is
        # non-blocking) and sends only while this much input is unanswered, far less than the pipe holds.
        os.set_blocking(self._in, False)
        self.limit = size // 8
        self.in_flight = 0  # bytes sent whose lines have not come back
        self._sizes: deque[int] = deque()  # each unanswered batch's input bytes, oldest first
        self._buf = bytearray()
        self.ready = False

    @property
    def pid(self) -> int:
        """The child's pid."""
        return self._proc.pid

    def poll_ready(self) -> bool:
        """Whether the child has started (imports done); never waits."""
        if not self.ready:
            try:
                got = os.read(self._in, 1)
            except BlockingIOError:
                return False
            if got != _READY:
                raise StageError(f"journal encoder exited at start (code {self._proc.poll()})")
            self.ready = True
        return self.ready

    def send(self, payload: bytes) -> None:
        """Queue one batch (``marshal.dumps`` of its events) for encoding."""
        try:
            _write_all(self._out, _HEAD.pack(len(payload)) + payload)
        except OSError as exc:
            raise StageError(f"journal encoder gone: {exc}") from None
        self._sizes.append(len(payload))
        self.in_flight += len(payload)

    def replies(self) -> list[tuple[bool, bytes]]:
        """Replies that have come back, oldest first, as (encoded, lines or error text); never waits."""
        out: list[tuple[bool, bytes]] = []
        while self._sizes:
            try:
                chunk = os.read(self._in, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                raise StageError(f"journal encoder exited (code {self._proc.poll()})")
            self._buf += chunk
            while len(self._buf) >= _HEAD.size:
                (head,) = _HEAD.unpack_from(self._buf)
                n = head & ~_FAILED
                if len(self._buf) < _HEAD.size + n:
                    break
                out.append((not head & _FAILED, bytes(self._buf[_HEAD.size : _HEAD.size + n])))
                del self._buf[: _HEAD.size + n]
                self.in_flight -= self._sizes.popleft()
        return out

    def close(self) -> None:
        """End the child (it exits when its input closes); what is in flight is dropped.

        Never waits for the child: a journal closes on the daemon's event loop, where a child slow to exit
        would hold up every run and client.  One still running is reaped on a thread (killed after
        ``REAP_S``)."""
        with contextlib.suppress(OSError):
            self._proc.stdin.close()  # type: ignore[union-attr]
        if self._proc.poll() is None:
            threading.Thread(target=_reap, args=(self._proc,), name="encoder-reap", daemon=True).start()
        else:
            _reap(self._proc)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for an encoder child whose input is closed (kill it after ``REAP_S``), then close its output:
    only now, so that a reply it is still writing does not end it with a broken pipe."""
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError):
        proc.stdout.close()  # type: ignore[union-attr]


def main() -> None:
    """The child: read batches from stdin, write their journal lines to stdout, until stdin closes."""
    from agent.runs.jsonline import encode_lines

    out, inp = sys.stdout.fileno(), sys.stdin.fileno()
    _write_all(out, _READY)
    while True:
        head = _read_exact(inp, _HEAD.size)
        if len(head) < _HEAD.size:
            return
        events: Any = marshal.loads(_read_exact(inp, _HEAD.unpack(head)[0]))
        try:
            lines = encode_lines(events)
        except Exception as exc:  # the daemon encodes this batch itself and meets the same error there
            err = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
            _write_all(out, _HEAD.pack(len(err) | _FAILED) + err)
            continue
        _write_all(out, _HEAD.pack(len(lines)) + lines)


if __name__ == "__main__":
    main()
