"""The journal's encoder stage: a child process that turns batches of events into journal lines.

While the daemon catches up on a backlog, JSON-encoding its events (~12 µs each, a third of the rules'
time) runs here, on another core, while the daemon reads and classifies the next chunk: a thread would
not help, as the encoder holds the GIL.  Events go in ``marshal``-ed (~1.4 µs each: the same dicts,
lists, strings and floats, bit for bit) and come back as the lines ``jsonline.encode_lines`` makes; the
child never touches the journal file, so a daemon killed mid-batch leaves nothing half-owned behind.

Frames both ways as childpipe.py writes them (a reply flagged failed carries the error text).  The child
writes ``R`` once it is ready.
"""

from __future__ import annotations

import marshal
import os
import sys
from collections import deque
from typing import Any

from agent.runs import childpipe
from agent.runs.childpipe import HEAD, read_exact, take_frame, write_all, write_frame

_READY = b"R"


#: ``on``, ``off`` (the default) or ``auto``: on with childpipe.MIN_CPUS CPUs or more.  With
#: fewer, the child takes its CPU time from the daemon's own core (measured on a 2-vCPU VM: slower).  Off
#: by default: each watched run would start a child, and on a 16-core H200 host a real daemon gained little
#: from it (tests/bench/bench_daemon_ingest.py: 0.69 of the pure loop's speed with it, 0.64 without; the
#: daemon's own CPU barely fell, since sending the batches and writing their lines back cost about what
#: encoding them did).
ENCODER_ENV = "EAGLEWATCH_AGENT_ENCODER"


def stage_wanted() -> bool:
    """Whether journals use an encoder stage for backlogs (``EAGLEWATCH_AGENT_ENCODER``; ValueError when
    it is set to something else than on, off or auto)."""
    return childpipe.wanted(ENCODER_ENV)


class StageError(Exception):
    """The encoder stage cannot take or return a batch (it died, or its pipe broke); the text says why."""


class EncoderStage:
    """The daemon's end of one encoder child: batches go out in order and their lines come back in order."""

    def __init__(self) -> None:
        self._proc = childpipe.spawn("agent.runs.encoder")
        self._out, self._in, size = childpipe.pipe_ends(self._proc)
        # The daemon never blocks on the child: it reads replies only when they are there (its end is
        # non-blocking) and sends only while this much input is unanswered, far less than the pipe holds.
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
            write_frame(self._out, payload)
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
            while (frame := take_frame(self._buf)) is not None:
                out.append((not frame[0], frame[1]))
                self.in_flight -= self._sizes.popleft()
        return out

    def close(self) -> None:
        """End the child (it exits when its input closes); what is in flight is dropped.

        Never waits for the child: a journal closes on the daemon's event loop, where a child slow to exit
        would hold up every run and client.  One still running is reaped on a thread (killed after
        ``childpipe.REAP_S``)."""
        childpipe.close(self._proc)


def main() -> None:
    """The child: read batches from stdin, write their journal lines to stdout, until stdin closes."""
    from agent.runs.jsonline import encode_lines

    out, inp = sys.stdout.fileno(), sys.stdin.fileno()
    write_all(out, _READY)
    while True:
        head = read_exact(inp, HEAD.size)
        if len(head) < HEAD.size:
            return
        events: Any = marshal.loads(read_exact(inp, HEAD.unpack(head)[0]))
        try:
            lines = encode_lines(events)
        except Exception as exc:  # the daemon encodes this batch itself and meets the same error there
            err = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
            write_frame(out, err, failed=True)
            continue
        write_frame(out, lines)


if __name__ == "__main__":
    main()
