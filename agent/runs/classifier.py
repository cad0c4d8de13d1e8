"""The watcher's classifier children: find which lines of each block may match, while the daemon reads on.

In one process the daemon's ingest is the pure splitter + rules loop plus everything done per event
(numbering, journal lines, the stream to followers), and can never reach the pure loop's speed.  The
rules' work has two halves (milestones/found.py): finding the lines that may match (fold every line's
digits, look its shape up in the prefilter: per line, stateless) and feeding those few lines to the
engine (plans, rank groups, tracebacks: state).  Children (``finders()``) do the first half on other cores,
blocks going round them in turn: the daemon reads and checks a chunk, sends the raw block of complete
lines (no object per line, not even counted: a count is a pass over every byte, which the child makes
anyway) and goes on to the next; the hits and the count come back and the daemon's own engine
(``RemoteEngine.engine``) takes them in log order.  The engine's state never leaves the daemon; a child
holds none (tests/bench/bench_rules_halves.py times the two halves).  Lines are numbered as they are
taken, so ``RemoteEngine.line`` is the watcher's line number while it has the children.

Ordering and the cursor: replies are taken in the order the blocks went out, and what the daemon does
with the engine between them (split lines, an in-line snapshot) waits in the same queue, so milestones
are journaled in log order.  Where the watcher needs the engine's answer now (caught up with the log, a
flush, a cursor) it drains the queue first.  During a backlog a cursor is asked for without draining: a
snapshot waits in line behind the blocks sent before it, and the state the daemon kept when it asked (log
offset, log generations) is completed with the line number reached there and the journal's seq once the
milestones before it are journaled (``on_snapshot``).

Frames both ways as childpipe.py writes them (a reply flagged failed when the op failed).  An op is one
byte, then its payload: ``I`` init (marshal: extra rules, backend), ``B`` a block (its raw lines).  A
reply is marshal of ``Found.to_tuple()`` (the block's line count first).  The child exits when its input
closes: it never outlives the daemon.
"""

from __future__ import annotations

import marshal
import os
import select
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.logs.block import Block
from agent.milestones.engine import MilestoneEngine, RuleError, load_rules
from agent.milestones.found import Found, find
from agent.milestones.logline import Prefilter
from agent.milestones.milestone import Milestone
from agent.runs import childpipe
from agent.runs.childpipe import HEAD, read_exact, take_frame, write_frame

#: ``on``, ``off`` or ``auto`` (the default: on with MIN_CPUS CPUs or more).  On a 16-core H200 host
#: (tests/bench/bench_daemon_ingest.py, 500,000 lines) a run caught up at 1.50-2.40M lines/s with it against
#: 0.99-1.22M without: the daemon's ingest at 0.94-2.05 of its pure core in the same rounds, not 0.66-0.74.
#: Four runs at once: 1.30M lines/s in all.  Each run holds ``finders()`` more processes, idle but for its
#: backlogs.
CLASSIFIER_ENV = "EAGLEWATCH_AGENT_CLASSIFIER"
#: How long one op may take in the child before the daemon gives up on it (rules are bounded per line, and
#: the daemon's loop waits meanwhile).
REPLY_TIMEOUT_S = 10.0
#: ``auto`` starts children with this many CPUs or more: even on two, one child finding while the daemon
#: does the rest beat the daemon alone (an H200 host pinned to 2 CPUs: 1.54-1.58M lines/s against
#: 1.29-1.42M).
MIN_CPUS = 2
_OP_NAMES = {b"I": "init", b"B": "block"}
OnMilestones = Callable[[list[Milestone]], None]
OnSnapshot = Callable[[dict[str, Any], dict[str, Any]], None]
OnCounted = Callable[[Block, int], None]


@dataclass(frozen=True, slots=True)
class _Sent:
    """A block sent to a child: the block, its frame's size, which child."""

    block: Block
    size: int
    kid: int


@dataclass(frozen=True, slots=True)
class _Call:
    """A call the engine takes in its turn, between the blocks sent before and after it (``lines``: how
    many log lines it feeds)."""

    call: Callable[[], list[Milestone]]
    lines: int


def finders() -> int:
    """Children per run, blocks going round them in turn: two with 4 CPUs or more (finding a block's likely
    lines costs about 0.8 of the pure rules loop, tests/bench/bench_rules_halves.py, so one child would set
    the pace), else one (on 2 CPUs two children and the daemon share the cores: 1.09-1.11M lines/s against
    1.54-1.58M with one)."""
    return 2 if childpipe.cpus() >= 4 else 1


def classifier_wanted() -> bool:
    """Whether watchers run their rules in a classifier child (``EAGLEWATCH_AGENT_CLASSIFIER``; ValueError
    when it is set to something else than on, off or auto)."""
    return childpipe.wanted(CLASSIFIER_ENV, default="auto", min_cpus=MIN_CPUS)


class ClassifierError(Exception):
    """A classifier child failed an op, died or stopped answering; the text says which and why."""


class RemoteEngine:
    """The daemon's engine with classifier children finding its blocks' likely lines (the calls the watcher
    makes on a MilestoneEngine, but for the lines' numbers: lines are numbered here, in their turn).

    ``feed_many``/``feed_block`` return at once; the milestones of earlier calls whose turn has come go to
    ``on_milestones`` meanwhile.  ``drain``, ``flush``, ``release_ready`` and ``snapshot`` first take every
    call still queued; ``line``, ``open_groups`` and ``world_size`` are the engine's as of the calls taken.
    A block's lines need not be counted before it is sent (``Block.counted`` False: counting is a pass over
    every byte, which a child makes anyway): once its hits are back, ``on_counted(block, lines)`` says how
    many it held."""

    def __init__(
        self,
        engine: MilestoneEngine,
        extra_rules: Any,
        backend: str,
        on_milestones: OnMilestones,
        on_snapshot: OnSnapshot,
        on_counted: OnCounted,
        line: int = 0,
        children: int | None = None,
    ) -> None:
        if not engine.prefilter.usable:
            raise ClassifierError("rules not prefiltered by line shape: nothing for a child to find")
        self.engine = engine
        self._kids = [_Kid(proc) for proc in _take_children(children or finders())]
        self._turn = 0  # the child the next block goes to: blocks go round them in turn
        # In log order: a block sent (the block, the size of its frame, the child it went to) or a call the
        # engine takes in its turn (no frame); lines are numbered as they are taken.
        self._queue: deque[_Sent | _Call] = deque()
        self._on_milestones = on_milestones
        self._on_snapshot = on_snapshot
        self._on_counted = on_counted
        self.line = line  # the number of the last line the engine has taken
        self.snapshot_pending = False
        init = marshal.dumps((extra_rules, backend))
        for kid in self._kids:
            kid.write(init, b"I")

    @property
    def pids(self) -> list[int]:
        """The children's pids, in the order blocks go round them."""
        return [kid.proc.pid for kid in self._kids]

    @property
    def outstanding(self) -> int:
        """Calls queued and not yet taken by the engine."""
        return len(self._queue)

    @property
    def open_groups(self) -> int:
        """The engine's rank groups still waiting for more ranks."""
        return self.engine.open_groups

    @property
    def world_size(self) -> int | None:
        """The engine's TP world size, where known."""
        return self.engine.world_size

    # --- the engine's calls --------------------------------------------------------------------------
    def feed_block(self, block: Block) -> list[Milestone]:
        """Send a block's lines to the next child in turn; milestones come through ``on_milestones`` once its
        hits are back and their turn has come."""
        size = 1 + len(block.data)
        turn, kid = self._turn, self._kids[self._turn]
        self._turn = (turn + 1) % len(self._kids)
        while kid.in_flight and kid.in_flight + size > kid.limit:
            self._take(wait_all=False, wait_one=True)
        kid.write(block.data, b"B")
        self._queue.append(_Sent(block, size, turn))
        kid.in_flight += size
        return []

    def feed_many(self, texts: Sequence[str]) -> list[Milestone]:
        """Split lines: fed in their turn (at once when nothing is queued, else through ``on_milestones``)."""
        if not texts:
            return []
        if not self._queue:
            return self._feed_texts(texts)
        texts = list(texts)
        self._queue.append(_Call(lambda: self._feed_texts(texts), len(texts)))
        return []

    def _feed_texts(self, texts: Sequence[str]) -> list[Milestone]:
        first = self.line + 1
        self.line += len(texts)
        return self.engine.feed_many(texts, first)

    def flush(self) -> list[Milestone]:
        """Everything before goes to ``on_milestones``; return what closing every group releases."""
        self.drain()
        return self.engine.flush()

    def release_ready(self) -> list[Milestone]:
        """Everything before goes to ``on_milestones``; return what the engine releases now."""
        self.drain()
        return self.engine.release_ready()

    def snapshot(self) -> dict[str, Any]:
        """The engine's snapshot, once every call before it is taken."""
        self.drain()
        return self.engine.snapshot()

    def request_snapshot(self, context: dict[str, Any]) -> None:
        """Ask for a snapshot in line with the blocks sent: ``on_snapshot(context, snapshot)`` follows the
        milestones of every call before it (``context`` gains ``line``, the line number reached there)."""
        self.snapshot_pending = True

        def reached() -> list[Milestone]:
            self.snapshot_pending = False
            self._on_snapshot({**context, "line": self.line}, self.engine.snapshot())
            return []

        self._queue.append(_Call(reached, 0))

    def drain(self) -> None:
        """Take every queued call (milestones go to ``on_milestones``), waiting for the children's hits."""
        self._take(wait_all=True)

    def poll(self) -> None:
        """Take the queued calls whose hits are there; never waits."""
        self._take(wait_all=False)

    def lines_not_taken(self) -> int:
        """The log lines in the calls still queued (blocks counted here), for a caller that gives up on
        them: ``line`` plus these is the number of the last line sent."""
        return sum(item.lines if isinstance(item, _Call) else _lines_of(item.block) for item in self._queue)

    def close(self) -> None:
        """End the children (each exits when its input closes); never waits for them on the caller's
        thread."""
        for kid in self._kids:
            childpipe.close(kid.proc)

    # --- the children's replies ----------------------------------------------------------------------
    def _take(self, *, wait_all: bool, wait_one: bool = False) -> None:
        """Take queued calls in order: a block once its reply is read (waiting for one where asked)."""
        while self._queue:
            item = self._queue[0]
            if isinstance(item, _Call):
                self._queue.popleft()
                found = item.call()
            else:
                kid = self._kids[item.kid]
                got = kid.read_reply(block=wait_all or wait_one)
                if got is None:
                    return
                wait_one = False
                failed, payload = got
                if failed:
                    text = payload.decode("utf-8", "replace")
                    raise ClassifierError(f"classifier child failed: {text}")
                self._queue.popleft()
                kid.in_flight -= item.size
                found = self._feed_found(item.block, Found(*marshal.loads(payload)))
            if found:
                self._on_milestones(found)

    def _feed_found(self, block: Block, found: Found) -> list[Milestone]:
        if block.counted and found.count != block.lines:
            raise ClassifierError(f"classifier child found {found.count} lines in a block of {block.lines}")
        first = self.line + 1
        self.line += found.count
        out = self.engine.feed_found(block.data, found, first)
        if not block.counted:
            self._on_counted(block, found.count)
        return out


def _lines_of(block: Block) -> int:
    return block.lines if block.counted else block.data.count(b"\n")


class _Kid:
    """The daemon's end of one classifier child: its pipes, replies read so far, input not answered yet."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.out, self.inp, size = childpipe.pipe_ends(proc)
        # Never more unanswered input than the pipe holds: a write then never blocks, so the daemon cannot
        # wait on the child while the child waits for the daemon to read a large reply.
        self.limit = size // 2
        self.in_flight = 0
        self.buf = bytearray()

    def write(self, payload: bytes, op: bytes) -> None:
        """One frame to the child."""
        try:
            write_frame(self.out, payload, op=op)
        except OSError as exc:
            raise ClassifierError(f"classifier child gone: {exc}") from None

    def read_reply(self, block: bool) -> tuple[bool, bytes] | None:
        """One whole reply frame, or None when none is complete and ``block`` is False."""
        while True:
            if (frame := take_frame(self.buf)) is not None:
                return frame
            if block:
                ready, _, _ = select.select([self.inp], [], [], REPLY_TIMEOUT_S)
                if not ready:
                    raise ClassifierError(f"classifier child did not answer within {REPLY_TIMEOUT_S:.0f} s")
            try:
                chunk = os.read(self.inp, 1 << 20)
            except BlockingIOError:
                return None
            if not chunk:
                raise ClassifierError(f"classifier child exited (code {self.proc.poll()})")
            self.buf += chunk


_spares: list[subprocess.Popen[bytes]] = []


def _start_child() -> subprocess.Popen[bytes]:
    return childpipe.spawn("agent.runs.classifier")


def prestart() -> None:
    """Start spare children now (their imports and rules compile while nothing waits on them), where
    wanted."""
    if classifier_wanted():
        _spares.extend(_start_child() for _ in range(finders() - len(_spares)))


def close_spare() -> None:
    """End the spare children, if any (the daemon's shutdown)."""
    while _spares:
        childpipe.close(_spares.pop())


def _take_children(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` children: the spares that are alive, new ones for the rest; and new spares for the next run."""
    taken = [proc for proc in _spares[:n] if proc.poll() is None]
    for proc in _spares[n:] + [p for p in _spares[:n] if p not in taken]:
        childpipe.close(proc)
    _spares.clear()
    taken += [_start_child() for _ in range(n - len(taken))]
    _spares.extend(_start_child() for _ in range(finders()))
    return taken


def main() -> None:
    """The child: build the prefilter from the init op, then find each block's likely lines until stdin
    closes."""
    out, inp = sys.stdout.fileno(), sys.stdin.fileno()
    prefilter: Prefilter | None = None
    for backend in ("command", "worker-extension", "vllm-native"):  # compiled now: init finds them cached
        load_rules(backend=backend)
    while True:
        head = read_exact(inp, HEAD.size)
        if len(head) < HEAD.size:
            return
        size = HEAD.unpack(head)[0]
        op = read_exact(inp, 1) if size else b""
        body = read_exact(inp, size - 1) if size > 1 else b""  # a block is not copied out of a frame
        try:
            if op == b"I":
                extra, backend = marshal.loads(body)
                try:
                    rules = load_rules(extra=extra, backend=backend)
                except (RuleError, TypeError):  # as the watcher does: a spec edited on disk gets built-ins
                    rules = load_rules(backend=backend)
                prefilter = MilestoneEngine(rules).prefilter
                continue
            if prefilter is None:
                raise ClassifierError("an op came before init")
            if op != b"B":
                raise ClassifierError(f"unknown op {op!r}")
            write_frame(out, marshal.dumps(find(prefilter, body).to_tuple()))
        except Exception as exc:  # named with its op: a failed init is answered in the first block's turn
            text = f"{_OP_NAMES.get(op, 'op')}: {type(exc).__name__}: {exc}"
            write_frame(out, text.encode("utf-8", "replace"), failed=True)


if __name__ == "__main__":
    main()
