"""output.log truncated (``truncate -s 0``) or renamed away (logrotate) mid-run: no line or milestone lost,
every streamed line keeps a distinct offset, and the timeline says what happened to the log."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from controller import crud, queries
from controller.logblocks import Block
from controller.store import Tx, connect, create_schema
from tests.helpers.agentjobs import marker, write_script
from tests.helpers.agentproc import (
    AgentClient,
    AgentProc,
    agent_daemon,
    cleanup_runs,
    log_lines,
    start_agent,
    terminal_event,
)

__all__ = ["agent_daemon"]

N = 600
EVERY = 50  # a progress marker every 50 lines: 12 milestones


def expected_lines() -> list[str]:
    """The 600 lines the job prints."""
    return [
        marker("progress", samples_done=i // EVERY + 1, samples_total=N // EVERY)
        if i % EVERY == EVERY - 1
        else f"plain line {i:04d} " + "x" * (i % 7)
        for i in range(N)
    ]


def log_job(tmp: Path, action: str) -> list[str]:
    """A job printing the lines; at line 300 it does ``action`` to its own output.log (fd 1)."""
    return write_script(
        tmp,
        f"job_{action}",
        f"""
        import os, time
        LINES = {expected_lines()!r}
        log = os.readlink("/proc/self/fd/1")
        for i, line in enumerate(LINES):
            if i == {N // 2}:
                time.sleep(0.6)  # the watcher has read everything before the seam
                if {action!r} == "truncate":
                    os.truncate(log, 0)
                elif {action!r} in ("rename", "rename_create"):
                    os.rename(log, log + ".1")
                    if {action!r} == "rename_create":
                        open(log, "w").close()  # logrotate's "create": a new empty file at the name
                elif {action!r} == "reopen":
                    os.rename(log, log + ".1")
                    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)  # a job that reopens its log after rotation
                time.sleep(0.1)
            print(line, flush=True)
            time.sleep(0.002)
        time.sleep(0.3)
    """,
    )


def _events(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["event"] for m in msgs if m.get("type") == "event"]


def run_and_collect(
    agent: AgentProc, tmp: Path, action: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Launch the job, follow it with its log to the end; (journal events, log blocks) as streamed."""
    with AgentClient(agent.socket) as c:
        c.result("launch", run=action, spec={"name": "t", "host": "h", "backend": "command",
                                             "command": log_job(tmp, action)})  # fmt: skip
        c.result("follow", run=action, after_seq=0, log_offset=0)
        msgs = c.wait_for(terminal_event, timeout=60)
        # the log stream may trail the journal's final state a little: read until the last line came
        batches = [m for m in msgs if m.get("type") == "log_block"]
        while sum(len(log_lines(b)) for b in batches) < N:
            m = c.read_message(timeout=10)
            if m.get("type") == "log_block":
                batches.append(m)
    return _events(msgs), batches


@pytest.mark.parametrize(
    ("action", "rule"),
    [("truncate", "log_truncated"), ("rename", "log_replaced"), ("rename_create", "log_replaced"),
     ("reopen", "log_replaced")],
)  # fmt: skip
def test_no_line_or_milestone_lost_when_the_log_is_truncated_or_rotated(
    agent_daemon: AgentProc, tmp_path: Path, action: str, rule: str
) -> None:
    events, batches = run_and_collect(agent_daemon, tmp_path, action)
    lines = [line for b in batches for line in log_lines(b)]
    offsets = [o for o, _ in lines]
    assert len(set(offsets)) == len(offsets) == N, (len(set(offsets)), len(offsets))
    assert offsets == sorted(offsets)
    assert [t for _, t in lines] == expected_lines()
    progress = [e for e in events if e.get("kind") == "progress"]
    assert [p["fields"]["samples_done"] for p in progress] == list(range(1, N // EVERY + 1))
    warnings = [e for e in events if e.get("kind") == "warning"]
    rules = [w["fields"]["rule"] for w in warnings]
    # a reopening job: "renamed away" may be seen before its new file has a line, then "replaced"
    assert rules == [rule] or (action == "reopen" and rules == [rule, rule]), warnings
    assert events[-1]["state"] == "completed"

    # What the controller stores (unique on run + offset) is every line, in order.
    db = tmp_path / "c.db"
    create_schema(db)
    conn = connect(db)
    try:
        tx = Tx(conn)
        crud.insert_run(
            tx=tx, run_id=action, name="t", host="h", backend="command", model=None, spec_json="{}"
        )
        for b in batches:
            crud.add_log_block(tx=tx, run_id=action, block=Block.from_message(b))
        stored = [ln["text"] for ln in queries.read_log(conn, action, -1, 100000, None, False)]
    finally:
        conn.close()
    assert stored == expected_lines()


def test_a_daemon_killed_after_the_log_was_rotated_picks_up_the_renamed_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        with AgentClient(agent.socket) as c:
            spec = {"name": "t", "host": "h", "backend": "command", "command": log_job(tmp_path, "rename")}
            c.result("launch", run="rot", spec=spec)
            c.result("follow", run="rot", after_seq=0)
            c.wait_for(lambda m: m.get("type") == "event" and m["event"].get("kind") == "warning")
        agent.kill()  # SIGKILL: the job goes on writing into output.log.1 while no daemon watches
        time.sleep(1.5)
        agent = start_agent(state)
        with AgentClient(agent.socket) as c:
            c.result("follow", run="rot", after_seq=0, log_offset=0)
            msgs = c.wait_for(terminal_event, timeout=60)
            batches = [m for m in msgs if m.get("type") == "log_block"]
            while sum(len(log_lines(b)) for b in batches) < N:
                m = c.read_message(timeout=10)
                if m.get("type") == "log_block":
                    batches.append(m)
    finally:
        agent.kill()
        cleanup_runs(state)
    events = _events(msgs)
    lines = [line for b in batches for line in log_lines(b)]
    assert [t for _, t in lines] == expected_lines()
    assert [o for o, _ in lines] == sorted({o for o, _ in lines})
    progress = [e["fields"]["samples_done"] for e in events if e.get("kind") == "progress"]
    assert progress == list(range(1, N // EVERY + 1))  # each once: exactly-once across the restart
    assert [e["fields"]["rule"] for e in events if e.get("kind") == "warning"] == ["log_replaced"]
    assert events[-1]["state"] == "completed"
