"""The classifier child (agent/runs/classifier.py): likely lines found in a process of their own give the
daemon's milestones in the daemon's order; a child that dies hands the run back to the daemon with nothing
lost or twice; no child outlives its daemon."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.jobs import procfs
from agent.logs.block import UNCOUNTED, Block
from agent.logs.splitter import LineSplitter
from agent.milestones.engine import Milestone, MilestoneEngine, load_rules
from agent.milestones.found import find
from agent.paths import read_json, run_paths
from agent.runs import childpipe, classifier
from agent.runs.classifier import CLASSIFIER_ENV, ClassifierError, RemoteEngine, classifier_wanted
from tests.agent.test_ingest_pipeline import _reference, assert_journal_holds
from tests.helpers.agentproc import AgentClient, child_pids, cleanup_runs, start_agent, terminal_event
from tests.helpers.vllm_log import make_log, steady_lines

CHUNK = 64 * 1024


@pytest.fixture(autouse=True)
def _no_spare_left() -> Iterator[None]:
    """Each RemoteEngine made here leaves a spare child for the next one: end it after the test."""
    yield
    classifier.close_spare()


def _log() -> bytes:
    """Steady TP=4 lines (rank groups), then a failing run's start and traceback, then steady lines again."""
    steady = "\n".join(steady_lines(20_000, tp=4, seed=5)) + "\n"
    return steady.encode() + make_log(tp=4, failure="oom", seed=2) + steady.encode()


def _remote(
    events: list[tuple[str, Any]],
    counted: list[tuple[int, int, int]] | None = None,
    children: int | None = None,
) -> RemoteEngine:
    """A RemoteEngine (with ``children`` children, else as many as this machine gets) whose milestones and
    snapshots (``n`` of the context, the line reached) go to ``events``, and the blocks' counts (offset,
    lines said, lines held) to ``counted``."""
    counts = [] if counted is None else counted
    return RemoteEngine(
        MilestoneEngine(load_rules(backend="command")),
        [],
        "command",
        lambda ms: events.extend(("ms", m.to_dict()) for m in ms),
        lambda ctx, snap: events.append(("snap", (ctx["n"], ctx["line"]))),
        lambda block, n: counts.append((block.offset, n, block.data.count(b"\n"))),
        children=children,
    )


def _feed(engine: MilestoneEngine | RemoteEngine, data: bytes) -> list[Milestone]:
    """The watcher's feeding: chunks → splitter.feed_block → feed_many for the head, feed_block for the
    rest (lines numbered here for a local engine; a RemoteEngine numbers them itself, and its blocks are
    neither folded nor counted)."""
    sp, out, n = LineSplitter(), [], 0
    for i in range(0, len(data), CHUNK):
        head, block = sp.feed_block(data[i : i + CHUNK], not isinstance(engine, RemoteEngine))
        texts = [ln.text for ln in head]
        if isinstance(engine, RemoteEngine):
            out += engine.feed_many(texts)
            if block is not None:
                assert not block.shapes and not block.counted  # the child folds and counts its lines
                out += engine.feed_block(block)
            continue
        out += engine.feed_many(texts, n + 1)
        n += len(head)
        if block is not None:
            out += engine.feed_block(block, n + 1)
            n += block.lines
    texts = [ln.text for ln in sp.flush()]
    out += engine.feed_many(texts) if isinstance(engine, RemoteEngine) else engine.feed_many(texts, n + 1)
    return out


def test_remote_engine_gives_the_in_process_milestones() -> None:
    """Blocks and split lines through a real child, then a flush: the in-process engine's milestones (rank
    groups, a traceback's root cause) in the same order, and the same snapshot before the flush."""
    data = _log()
    local = MilestoneEngine(load_rules(backend="command"))
    want = [m.to_dict() for m in _feed(local, data)]
    events: list[tuple[str, Any]] = []
    counted: list[tuple[int, int, int]] = []
    remote = _remote(events, counted)
    try:
        assert _feed(remote, data) == []  # the milestones come through the callback
        assert remote.snapshot() == local.snapshot()
        assert remote.line == data.count(b"\n") and remote.lines_not_taken() == 0
        assert remote.open_groups == local.open_groups and remote.world_size == local.world_size
        want += [m.to_dict() for m in local.flush()]
        flushed = [m.to_dict() for m in remote.flush()]
    finally:
        remote.close()
    got = [m for kind, m in events if kind == "ms"] + flushed
    assert len(want) > 1000 and any(m["kind"] == "error" for m in want)
    assert got == want
    # every block's count came back, in log order, and each is the count of the lines it holds
    assert len(counted) > 10 and [at for at, _, _ in counted] == sorted(at for at, _, _ in counted)
    assert all(said == held > 0 for _, said, held in counted)


def test_a_snapshot_asked_in_line_follows_the_milestones_before_it() -> None:
    """request_snapshot does not wait: its callback comes after every milestone of the blocks sent before it
    and before any of those sent after it."""
    data = ("\n".join(steady_lines(6_000, tp=4, seed=1)) + "\n").encode()
    half = data.rindex(b"\n", 0, len(data) // 2) + 1
    ref = MilestoneEngine(load_rules(backend="command"))
    first_half = len(_feed(ref, data[:half]))
    events: list[tuple[str, Any]] = []
    remote = _remote(events)
    try:
        _feed(remote, data[:half])
        remote.request_snapshot({"n": 1})
        assert remote.snapshot_pending
        _feed(remote, data[half:])  # numbered on from where the first half ended
        remote.drain()
    finally:
        remote.close()
    at = events.index(("snap", (1, data[:half].count(b"\n"))))
    assert first_half > 10 and at == first_half and len(events) > at + 10
    assert not remote.snapshot_pending


def test_a_dead_child_raises_classifier_error() -> None:
    """A child killed under the daemon: the wait for a block's hits names the exit instead of hanging (and
    the lines not taken are known), and a block sent to a child already gone says so at once."""
    block = Block(0, b"INFO ready\n" * 10, [], UNCOUNTED)
    events: list[tuple[str, Any]] = []
    remote = _remote(events)
    try:
        remote.drain()
        os.kill(remote.pids[0], signal.SIGSTOP)  # it must not answer the block before it dies
        remote.feed_block(block)
        remote.feed_many(["INFO after", "INFO the block"])  # queued behind it
        os.kill(remote.pids[0], signal.SIGKILL)
        with pytest.raises(ClassifierError, match="exited"):
            remote.flush()
        # what a caller giving up on the child counts on: the lines sent and never taken
        assert remote.line == 0 and remote.lines_not_taken() == 12
    finally:
        remote.close()
    remote = _remote(events)
    try:
        os.kill(remote.pids[0], signal.SIGKILL)
        while (st := procfs.stat(remote.pids[0])) is not None and st.state != "Z":
            time.sleep(0.01)  # dead (its pipe's end closed with it), not reaped
        with pytest.raises(ClassifierError, match="gone"):
            remote.feed_block(block)
    finally:
        remote.close()


def test_a_failed_op_is_named_in_its_reply() -> None:
    """An init the child cannot read has no reply of its own: its failure comes back in the first block's
    turn, named as the init's (and the block that follows, with no rules, names itself)."""
    proc = childpipe.spawn("agent.runs.classifier")
    try:
        out, inp, _ = childpipe.pipe_ends(proc)
        os.set_blocking(inp, True)
        childpipe.write_frame(out, b"not marshal", op=b"I")
        childpipe.write_frame(out, b"INFO ready\n", op=b"B")
        replies = []
        for _ in range(2):
            (head,) = childpipe.HEAD.unpack(childpipe.read_exact(inp, childpipe.HEAD.size))
            size = head & ~childpipe.FAILED
            replies.append((bool(head & childpipe.FAILED), childpipe.read_exact(inp, size)))
    finally:
        childpipe.close(proc)
    assert replies[0][0] and replies[0][1].startswith(b"init: ValueError: bad marshal data")
    assert replies[1] == (True, b"block: ClassifierError: an op came before init")


def test_blocks_go_round_the_children_and_are_taken_in_order() -> None:
    """Blocks go to the children in turn; while the second child is stopped, the first child's answer to the
    third block waits behind the second block's, and everything comes in log order once it goes on."""
    data = ("\n".join(steady_lines(3_000, tp=4, seed=2)) + "\n").encode()
    cuts = [0, *(data.index(b"\n", len(data) * k // 3) + 1 for k in (1, 2)), len(data)]
    blocks = [
        Block(cuts[k], data[cuts[k] : cuts[k + 1]], [], data[cuts[k] : cuts[k + 1]].count(b"\n"))
        for k in range(3)
    ]
    ref = MilestoneEngine(load_rules(backend="command"))
    want, n = [], 0
    for b in blocks:
        want += [m.to_dict() for m in ref.feed_found(b.data, find(ref.prefilter, b.data), n + 1)]
        n += b.lines
    events: list[tuple[str, Any]] = []
    remote = _remote(events, children=2)  # two on any machine: the turns are what is tested
    try:
        assert len(remote.pids) == 2
        os.kill(remote.pids[1], signal.SIGSTOP)
        for b in blocks:
            remote.feed_block(b)
        deadline = time.monotonic() + 10
        while remote.outstanding > 2 and time.monotonic() < deadline:
            remote.poll()
            time.sleep(0.01)
        time.sleep(0.2)  # the third block's answer is back by now; it must still wait its turn
        remote.poll()
        assert remote.outstanding == 2 and events  # the first block's milestones only
        first = len(events)
        os.kill(remote.pids[1], signal.SIGCONT)
        remote.drain()
    finally:
        remote.close()
    assert [m for _, m in events] == want and 0 < first < len(want)


def test_the_mode_is_on_off_or_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """on and off are obeyed, auto (also where unset) follows the CPUs (and so does the number of children
    per run), anything else is an error naming the variable."""
    monkeypatch.delenv(CLASSIFIER_ENV, raising=False)
    assert classifier_wanted() == (len(os.sched_getaffinity(0)) >= 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # a GPU host's CPUs
    assert classifier_wanted() and classifier.finders() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a small VM's
    assert classifier_wanted() and classifier.finders() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert not classifier_wanted()
    monkeypatch.setenv(CLASSIFIER_ENV, "on")
    assert classifier_wanted()
    monkeypatch.setenv(CLASSIFIER_ENV, "off")
    assert not classifier_wanted()
    monkeypatch.setenv(CLASSIFIER_ENV, "auto")
    assert not classifier_wanted()
    monkeypatch.setenv(CLASSIFIER_ENV, "yes")
    with pytest.raises(ValueError, match=CLASSIFIER_ENV):
        classifier_wanted()


def _classifier_children(daemon_pid: int) -> list[int]:
    """The daemon's classifier children (the run's and the spares)."""
    return [pid for pid in child_pids(daemon_pid) if "agent.runs.classifier" in procfs.cmdline(pid)]


def test_the_run_goes_on_in_the_daemon_when_its_child_dies(tmp_path: Path) -> None:
    """The classifier children are killed mid-backlog: the watcher goes back to its cursor with the rules in
    the daemon, and the journal still holds the line-by-line milestones once each, seqs consecutive."""
    data = ("\n".join(steady_lines(300_000, tp=4, seed=3)) + "\n").encode()
    log = tmp_path / "big.log"
    log.write_bytes(data)
    state = tmp_path / "state"
    paths = run_paths(state, "big")
    agent = start_agent(state, env={CLASSIFIER_ENV: "on"})
    try:
        with AgentClient(agent.socket, timeout=120) as c:
            c.result("launch", run="big", spec={"backend": "command", "command": ["cat", str(log)]})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # a cursor from the child's snapshot, mid-backlog
                cursor = read_json(paths.cursor)
                if isinstance(cursor, dict) and cursor.get("seq", 0) > 20:
                    break
                time.sleep(0.005)
            children = _classifier_children(agent.pid)
            assert len(children) == 2 * classifier.finders()  # the run's and the spares
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            assert 0 < read_json(paths.cursor)["offset"] < len(data), "not killed mid-backlog"
            c.result("follow", run="big", after_seq=0)
            c.wait_for(terminal_event, timeout=120)
    finally:
        agent.kill()
        cleanup_runs(state)
    assert_journal_holds(paths.events, _reference(data))
    assert "classifying in the daemon from the cursor" in (state / "daemon.stderr").read_text()


def test_no_child_outlives_its_daemon(tmp_path: Path) -> None:
    """The daemon is SIGKILLed (not its process group): its classifier children see their input close and
    exit."""
    state = tmp_path / "state"
    agent = start_agent(state, env={CLASSIFIER_ENV: "on"})
    try:
        with AgentClient(agent.socket, timeout=60) as c:
            c.result("launch", run="r", spec={"backend": "command", "command": ["sleep", "60"]})
            deadline = time.monotonic() + 10
            want = 2 * classifier.finders()  # the run's and the spares
            while len(children := _classifier_children(agent.pid)) < want and time.monotonic() < deadline:
                time.sleep(0.05)
        assert len(children) == want
        os.kill(agent.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        alive = children
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [pid for pid in children if (st := procfs.stat(pid)) is not None and st.state != "Z"]
        assert alive == []
    finally:
        agent.kill()
        cleanup_runs(state)
