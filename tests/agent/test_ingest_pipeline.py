"""The daemon's ingest path outside the rules: journal fsyncs in a worker thread behind the reads, the cursor
after them, followers reading the journal undecoded; a SIGKILL mid-backlog loses and repeats nothing."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import MilestoneEngine, load_rules
from agent.paths import read_json, run_paths
from agent.runs.journal import Journal, read_raw, scan
from tests.helpers.agentproc import AgentClient, cleanup_runs, start_agent, terminal_event
from tests.helpers.vllm_log import steady_lines


def test_read_raw_reports_each_line_with_its_own_seq(tmp_path: Path) -> None:
    """Consecutive seqs take the fast path; a gap, a repeat or another key order gets the lines' real seqs."""
    path = tmp_path / "events.jsonl"
    j = Journal(path)
    j.append_many([{"type": "x", "n": i} for i in range(50)], sync=False)
    j.close()
    found, end = read_raw(path, 0)
    assert [s for s, _ in found] == list(range(1, 51)) and end == path.stat().st_size
    assert all(raw.startswith(b'{"seq":%d,' % s) for s, raw in found)
    cases = {
        b'{"seq":1,"a":1}\n{"seq":2,"a":1}\n{"seq":5,"a":1}\n': [1, 2, 5],
        b'{"seq":1,"a":1}\n{"seq":1,"a":2}\n{"seq":2,"a":1}\n': [1, 1, 2],
        b'{"seq":7,"a":1}\n{"a":1,"seq":8}\n{"seq":9}\n': [7, 8, 9],
        b'{"seq":3,"a":1}\n{"seq":4,"a":1\n{"seq":5,"a":1}\n': [3, 5],  # a line that is no JSON object
    }
    for data, seqs in cases.items():
        path.write_bytes(data)
        assert [s for s, _ in read_raw(path, 0)[0]] == seqs, data


def test_fsync_in_a_worker_thread_while_events_are_written(tmp_path: Path) -> None:
    """sync() runs in another thread while the loop thread writes on; close() waits for an fsync in flight;
    every event is in the file once, in seq order, and a write during an fsync leaves one to do."""
    j = Journal(tmp_path / "events.jsonl")
    stop = threading.Event()
    errors: list[BaseException] = []

    def syncing() -> None:
        try:
            while not stop.is_set():
                j.sync()
        except BaseException as e:  # the assertion below names it
            errors.append(e)

    worker = threading.Thread(target=syncing)
    worker.start()
    for i in range(200):
        j.append_many([{"type": "x", "i": i}, {"type": "y", "i": i}], sync=False)
    stop.set()
    worker.join(10)
    j.append_many([{"type": "z"}], sync=False)
    assert j.unsynced  # written after the worker's last fsync: the next sync() covers it
    j.sync()
    assert not j.unsynced
    worker = threading.Thread(target=j.sync)
    worker.start()
    j.close()  # waits for the fsync in flight, if any, instead of closing its descriptor under it
    worker.join(10)
    assert errors == []
    assert [e["seq"] for e in scan(tmp_path / "events.jsonl")] == list(range(1, 402))


def _reference(data: bytes) -> list[dict[str, Any]]:
    """Milestones of the line-by-line path over the whole log."""
    sp, eng = LineSplitter(), MilestoneEngine(load_rules(backend="command"))
    texts = [ln.text for ln in sp.feed(data) + sp.flush()]
    out = [m for i, t in enumerate(texts) for m in eng.feed(t, i + 1)] + eng.flush()
    return [m.to_dict() for m in out]


def test_sigkill_mid_backlog_loses_and_repeats_no_milestone(tmp_path: Path) -> None:
    """The daemon is killed while it catches up on a large log (fsyncs behind the reads, cursors after
    them); the next daemon resumes from the cursor: the journal holds the line-by-line milestones once
    each, with consecutive seqs, and the cursor never pointed past the journal."""
    data = ("\n".join(steady_lines(300_000, tp=4, seed=3)) + "\n").encode()
    log = tmp_path / "big.log"
    log.write_bytes(data)
    want = _reference(data)
    state = tmp_path / "state"
    paths = run_paths(state, "big")
    agent = start_agent(state)
    try:
        with AgentClient(agent.socket, timeout=60) as c:
            c.result("launch", run="big", spec={"backend": "command", "command": ["cat", str(log)]})
        # Kill once the journal holds a few events: its lines are written as the log is read, ahead of the
        # fsync that a cursor waits for (a cursor may not exist yet: the next daemon then starts over).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _lines(paths.events) <= 20:
            time.sleep(0.005)
        agent.kill()
        journal = scan(paths.events)
        assert not any(e.get("state") == "completed" for e in journal), "not killed mid-backlog"
        cursor = read_json(paths.cursor)
        if isinstance(cursor, dict):
            assert cursor["offset"] < len(data)
            assert cursor["seq"] <= len(journal)  # the cursor never points past the journal
        agent = start_agent(state)
        with AgentClient(agent.socket, timeout=120) as c:
            c.result("follow", run="big", after_seq=0)
            c.wait_for(terminal_event, timeout=120)
    finally:
        agent.kill()
        cleanup_runs(state)
    assert len(want) > 1000
    assert_journal_holds(paths.events, want)


def _lines(path: Path) -> int:
    """How many lines ``path`` holds now (0 while it does not exist)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def assert_journal_holds(path: Path, want: list[dict[str, Any]]) -> None:
    """The journal at ``path``: consecutive seqs, the milestones ``want`` once each in order, completed."""
    events = scan(path)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    keys = ("kind", "line", "rank", "fields", "text")
    got = [{k: e[k] for k in keys} for e in events if e.get("type") == "milestone" and e["line"] > 0]
    assert got == want
    assert events[-1]["type"] == "state" and events[-1]["state"] == "completed"
