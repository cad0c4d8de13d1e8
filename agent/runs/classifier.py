"""The watcher's classifier child: the milestone engine in a process of its own, fed as the daemon reads on.

In one process the daemon's ingest is the pure splitter + rules loop plus everything done per event
(numbering, journal lines, the stream to followers), and can never reach the pure loop's speed.  With
this child the rules run on another core: the daemon reads and splits a chunk, sends the raw block of
complete lines (no object per line) and goes on to the next while the child classifies it; milestones
come back in order and are journaled as they arrive.

Ordering and the cursor: replies come back in the order the ops went out, so milestones are journaled in
log order.  Where the watcher needs the engine's answer now (caught up with the log, a flush, a cursor)
it drains every outstanding reply first.  During a backlog a cursor is asked for without draining: a
snapshot op travels in line with the blocks, and the state the daemon kept when it sent it (log offset,
line number, log generations) is completed with the journal's seq once the milestones before it are
journaled (``on_snapshot``).

Frames both ways as childpipe.py writes them (a reply flagged failed when the op failed).  An op is one
byte, then its payload: ``I`` init (marshal: extra rules, backend, world size, snapshot), ``B`` a block
(8-byte first line number, then its raw lines), ``M`` lines (marshal: texts, first line number), ``F``
flush, ``R`` release_ready, ``P`` snapshot.  A reply is marshal of (open groups, world size, milestones as
tuples) or, for ``P``, of the snapshot.  The child exits when its input closes: it never outlives the
daemon.
"""

from __future__ import annotations

import marshal
import os
import select
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from agent.logs.block import DIGIT_FOLD, Block
from agent.milestones.milestone import Milestone
from agent.runs import childpipe
from agent.runs.childpipe import HEAD, read_exact, take_frame, write_frame

#: ``on``, ``off`` (the default) or ``auto``: on with childpipe.MIN_CPUS CPUs or more.  Off by default: on a
#: 16-core H200 host (tests/bench/bench_daemon_ingest.py, 500,000 lines) a run caught up in 0.35-0.36 s with
#: it against 0.37-0.50 s without, and four runs at once gained nothing (1.15-1.23M lines/s in all against
#: 1.07-1.17M): the daemon still reads, checks and counts every block, writes it into the pipe and
#: journals every event, about as much CPU per run as the rules themselves.
CLASSIFIER_ENV = "EAGLEWATCH_AGENT_CLASSIFIER"
#: How long one op may take in the child before the daemon gives up on it (rules are bounded per line, and
#: the daemon's loop waits meanwhile).
REPLY_TIMEOUT_S = 10.0
_FIRST = struct.Struct("<q")
OnMilestones = Callable[[list[Milestone]], None]
OnSnapshot = Callable[[dict[str, Any], dict[str, Any]], None]


def classifier_wanted() -> bool:
    """Whether watchers run their rules in a classifier child (``EAGLEWATCH_AGENT_CLASSIFIER``; ValueError
    when it is set to something else than on, off or auto)."""
    return childpipe.wanted(CLASSIFIER_ENV)


class ClassifierError(Exception):
    """The classifier child failed an op, died or stopped answering; the text says which and why."""


class RemoteEngine:
    """The daemon's end of one classifier child, in place of a MilestoneEngine (the calls the watcher makes).

    ``feed_many``/``feed_block`` return at once; the milestones of earlier ops that have come back go to
    ``on_milestones`` meanwhile.  ``drain``, ``flush``, ``release_ready`` and ``snapshot`` wait for every
    reply still out; ``open_groups`` and ``world_size`` are as of the last reply."""

    def __init__(
        self,
        extra_rules: Any,
        backend: str,
        world_size: int | None,
        snapshot: dict[str, Any] | None,
        on_milestones: OnMilestones,
        on_snapshot: OnSnapshot,
    ) -> None:
        self._proc = _take_child()
        self._out, self._in, size = childpipe.pipe_ends(self._proc)
        # Never more unanswered input than the pipe holds: a write then never blocks, so the daemon cannot
        # wait on the child while the child waits for the daemon to read a large reply.
        self.limit = size // 2
        self.in_flight = 0
        self._pending: deque[tuple[str, int, dict[str, Any] | None]] = deque()  # op, bytes, snapshot context
        self._buf = bytearray()
        self._on_milestones = on_milestones
        self._on_snapshot = on_snapshot
        self.open_groups = 0
        self.world_size = world_size
        self.snapshot_pending = False
        self._send("I", marshal.dumps((extra_rules, backend, world_size, snapshot)))

    @property
    def pid(self) -> int:
        """The child's pid."""
        return self._proc.pid

    @property
    def outstanding(self) -> int:
        """Ops sent whose replies have not been taken in."""
        return len(self._pending)

    # --- the engine's calls --------------------------------------------------------------------------
    def feed_block(self, block: Block, first: int) -> list[Milestone]:
        """Send a block's lines (numbered from ``first``); milestones come through ``on_milestones``."""
        self._send("B", _FIRST.pack(first) + block.data)
        return []

    def feed_many(self, texts: Sequence[str], first: int) -> list[Milestone]:
        """Send split lines (numbered from ``first``); milestones come through ``on_milestones``."""
        if texts:
            self._send("M", marshal.dumps((list(texts), first)))
        return []

    def flush(self) -> list[Milestone]:
        """Everything before goes to ``on_milestones``; return what closing every group releases."""
        return self._call("F")

    def release_ready(self) -> list[Milestone]:
        """Everything before goes to ``on_milestones``; return what the engine releases now."""
        return self._call("R")

    def snapshot(self) -> dict[str, Any]:
        """The engine's snapshot, once every op before it is answered."""
        self._send("P", b"")
        snap: dict[str, Any] = {}
        self._take(wait_all=True, sink=snap)
        return snap

    def request_snapshot(self, context: dict[str, Any]) -> None:
        """Ask for a snapshot in line with the blocks sent: ``on_snapshot(context, snapshot)`` follows the
        milestones of every op sent before it."""
        self.snapshot_pending = True
        self._send("P", b"", context)

    def drain(self) -> None:
        """Wait for every reply still out (their milestones go to ``on_milestones``)."""
        self._take(wait_all=True)

    def poll(self) -> None:
        """Take in the replies that are there; never waits."""
        self._take(wait_all=False)

    def close(self) -> None:
        """End the child (it exits when its input closes); never waits for it on the caller's thread."""
        childpipe.close(self._proc)

    # --- the pipe ----------------------------------------------------------------------------------
    def _call(self, op: str) -> list[Milestone]:
        self._send(op, b"")
        out: list[Milestone] = []
        self._take(wait_all=True, sink=out)
        return out

    def _send(self, op: str, payload: bytes, context: dict[str, Any] | None = None) -> None:
        frame = op.encode() + payload
        while self.in_flight and self.in_flight + len(frame) > self.limit:
            self._take(wait_all=False, wait_one=True)
        try:
            write_frame(self._out, frame)
        except OSError as exc:
            raise ClassifierError(f"classifier child gone: {exc}") from None
        self._pending.append((op, len(frame), context))
        self.in_flight += len(frame)

    def _take(self, *, wait_all: bool, wait_one: bool = False, sink: Any = None) -> None:
        """Read replies and dispatch them in order.  A reply to the last op goes into ``sink`` (a list for
        flush/release, a dict for snapshot) where one is given."""
        while self._pending:
            got = self._read_reply(block=wait_all or wait_one)
            if got is None:
                return
            wait_one = False
            op, size, context = self._pending.popleft()
            self.in_flight -= size
            failed, payload = got
            if failed:
                text = payload.decode("utf-8", "replace")
                raise ClassifierError(f"classifier child failed op {op}: {text}")
            reply = marshal.loads(payload)
            last = not self._pending
            if op == "P":
                if context is not None:  # asked for in line with the blocks
                    self.snapshot_pending = False
                    self._on_snapshot(context, reply)
                elif isinstance(sink, dict):
                    sink.update(reply)
                continue
            self.open_groups, self.world_size, rows = reply
            found = [Milestone(*row) for row in rows]
            if last and isinstance(sink, list) and op in ("F", "R"):
                sink.extend(found)
            elif found:
                self._on_milestones(found)

    def _read_reply(self, block: bool) -> tuple[bool, bytes] | None:
        """One whole reply frame, or None when none is complete and ``block`` is False."""
        while True:
            if (frame := take_frame(self._buf)) is not None:
                return frame
            if block:
                ready, _, _ = select.select([self._in], [], [], REPLY_TIMEOUT_S)
                if not ready:
                    raise ClassifierError(f"classifier child did not answer within {REPLY_TIMEOUT_S:.0f} s")
            try:
                chunk = os.read(self._in, 1 << 20)
            except BlockingIOError:
                return None
            if not chunk:
                raise ClassifierError(f"classifier child exited (code {self._proc.poll()})")
            self._buf += chunk


_spare: subprocess.Popen[bytes] | None = None


def _start_child() -> subprocess.Popen[bytes]:
    return childpipe.spawn("agent.runs.classifier")


def prestart() -> None:
    """Start a spare child now (its imports and rules compile while nothing waits on it), where wanted."""
    global _spare
    if _spare is None and classifier_wanted():
        _spare = _start_child()


def close_spare() -> None:
    """End the spare child, if any (the daemon's shutdown)."""
    global _spare
    if _spare is not None:
        childpipe.close(_spare)
        _spare = None


def _take_child() -> subprocess.Popen[bytes]:
    """The spare child (a new one when there is none or it died), and a new spare for the next run."""
    global _spare
    proc, _spare = _spare, None
    if proc is None or proc.poll() is not None:
        proc = _start_child()
    _spare = _start_child()
    return proc


def main() -> None:
    """The child: build the engine from the init op, then answer ops until stdin closes."""
    from agent.milestones.engine import MilestoneEngine, RuleError, load_rules

    out, inp = sys.stdout.fileno(), sys.stdin.fileno()
    engine: MilestoneEngine | None = None
    for backend in ("command", "worker-extension", "vllm-native"):  # compiled now: init finds them cached
        load_rules(backend=backend)
    while True:
        head = read_exact(inp, HEAD.size)
        if len(head) < HEAD.size:
            return
        frame = read_exact(inp, HEAD.unpack(head)[0])
        op, body = frame[:1], frame[1:]
        try:
            if op == b"I":
                extra, backend, world, snap = marshal.loads(body)
                try:
                    rules = load_rules(extra=extra, backend=backend)
                except (RuleError, TypeError):  # as the watcher does: a spec edited on disk gets built-ins
                    rules = load_rules(backend=backend)
                engine = MilestoneEngine.restore(rules, snap) if snap else MilestoneEngine(rules, world)
                found: list[Milestone] = []
            elif engine is None:
                raise ClassifierError("an op came before init")
            elif op == b"B":
                (first,) = _FIRST.unpack_from(body)
                data = body[_FIRST.size :]
                shapes = data.translate(DIGIT_FOLD).split(b"\n")
                shapes.pop()
                found = engine.feed_block(Block(0, data, shapes), first)
            elif op == b"M":
                texts, first = marshal.loads(body)
                found = engine.feed_many(texts, first)
            elif op == b"F":
                found = engine.flush()
            elif op == b"R":
                found = engine.release_ready()
            elif op == b"P":
                write_frame(out, marshal.dumps(engine.snapshot()))
                continue
            else:
                raise ClassifierError(f"unknown op {op!r}")
            rows = [(m.kind, m.line, m.rank, m.fields, m.text) for m in found]
            write_frame(out, marshal.dumps((engine.open_groups, engine.world_size, rows)))
        except Exception as exc:
            write_frame(out, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"), failed=True)


if __name__ == "__main__":
    main()
