"""Daemon restarts: SIGKILL mid-run loses no line and duplicates no seq; finished and lost runs re-adopted."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.jobs import procfs
from agent.paths import atomic_write_json, read_json, run_paths
from tests.helpers.agentjobs import marker, printer, write_script
from tests.helpers.agentproc import (
    AgentClient,
    AgentProc,
    cleanup_runs,
    log_lines,
    start_agent,
    terminal_event,
)


@pytest.fixture
def state(tmp_path: Path) -> Any:
    st = tmp_path / "state"
    procs: list[AgentProc] = []

    def start(*args: str) -> AgentProc:
        agent = start_agent(st, args=args)
        procs.append(agent)
        return agent

    yield st, start
    for agent in procs:
        agent.kill()
    cleanup_runs(st)


def _journal(st: Path, run: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run_paths(st, run).events.read_text().splitlines()]


def _seq_at_least(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda m: m.get("type") == "event" and m["event"]["seq"] >= n


def _cmd(argv: list[str]) -> dict[str, Any]:
    return {"name": "t", "host": "local", "backend": "command", "command": argv}


@pytest.mark.parametrize("mode", ["inotify", "polling"])
def test_sigkilled_daemon_loses_no_line_and_duplicates_no_seq(state: Any, tmp_path: Path, mode: str) -> None:
    st, start0 = state
    args = ("--poll",) if mode == "polling" else ()

    def start() -> AgentProc:
        return start0(*args)

    n = 240
    lines: list[str] = []
    for i in range(n):
        lines.append(
            marker("progress", samples_done=i, samples_total=n) if i % 3 == 0 else f"plain line {i} é"
        )
    argv = printer(tmp_path, lines, delay=0.01)
    agent = start()
    received: dict[int, str] = {}
    seqs: list[int] = []
    next_offset = 0
    after_seq = 0

    def consume(msgs: list[dict[str, Any]]) -> None:
        nonlocal next_offset, after_seq
        for m in msgs:
            if m.get("type") == "log_block":
                for offset, text in log_lines(m):
                    assert offset not in received, f"line at {offset} delivered twice"
                    received[offset] = text
                next_offset = m["next_offset"]
            elif m.get("type") == "event":
                seqs.append(m["event"]["seq"])
                after_seq = m["event"]["seq"]

    with AgentClient(agent.socket) as c:
        c.result("launch", run="kill", spec=_cmd(argv))
        c.result("follow", run="kill", after_seq=0, log_offset=0)
        consume(c.wait_for(lambda m: m.get("type") == "event" and m["event"]["seq"] >= 15))
    for threshold in (45, None):
        agent.kill()  # SIGKILL: no cursor save, no goodbye
        agent = start()
        with AgentClient(agent.socket) as c:
            c.result("follow", run="kill", after_seq=after_seq, log_offset=next_offset)
            if threshold is None:
                consume(c.wait_for(terminal_event, timeout=60))
                msgs = (
                    c.wait_for(
                        lambda m: any(t == lines[-1] for _, t in log_lines(m)),
                        timeout=10,
                    )
                    if lines[-1] not in received.values()
                    else []
                )
                consume(msgs)
            else:
                consume(c.wait_for(_seq_at_least(threshold), 60))
    journal = _journal(st, "kill")
    assert [e["seq"] for e in journal] == list(range(1, len(journal) + 1))
    assert seqs == [e["seq"] for e in journal]  # the follower saw each event once, in order
    done = [e["fields"]["samples_done"] for e in journal if e.get("kind") == "progress"]
    assert sorted(done) == list(range(0, n, 3))  # every marker, none twice
    assert journal[-1]["state"] == "completed"
    raw = run_paths(st, "kill").log.read_bytes()
    expected = {}
    pos = 0
    for line in raw.split(b"\n")[:-1]:
        expected[pos] = line.decode()
        pos += len(line) + 1
    assert received == expected


def test_job_finished_while_daemon_down_is_journaled_once(state: Any, tmp_path: Path) -> None:
    st, start = state
    agent = start()
    argv = write_script(
        tmp_path,
        "quick",
        """
        import sys, time
        time.sleep(0.5)
        print("Traceback (most recent call last):", flush=True)
        print("RuntimeError: NCCL error: unhandled cuda error", flush=True)
        sys.exit(1)
    """,
    )
    with AgentClient(agent.socket) as c:
        c.result("launch", run="down", spec=_cmd(argv))
    agent.kill()
    paths = run_paths(st, "down")
    deadline = time.monotonic() + 20
    while read_json(paths.exit) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_json(paths.exit)["code"] == 1
    with open(paths.events, "ab") as fh:
        fh.write(b'{"seq": 99, "type": "mile')  # a write torn by the crash
    agent = start()
    with AgentClient(agent.socket) as c:
        c.result("follow", run="down", after_seq=0)
        last = c.wait_for(terminal_event)[-1]["event"]
    assert last["state"] == "failed" and "exit code 1" in last["reason"] and "nccl" in last["reason"]
    journal = _journal(st, "down")
    assert [e["seq"] for e in journal] == list(range(1, len(journal) + 1))
    agent.kill()
    agent = start()
    with AgentClient(agent.socket) as c:
        assert c.result("status", run="down")["state"] == "failed"
        assert c.result("status", run="down")["last_seq"] == len(journal)
    assert _journal(st, "down") == journal  # nothing journaled twice


@pytest.mark.parametrize("fake", ["dead_pid", "other_boot"])
def test_run_without_job_or_exit_is_lost(state: Any, fake: str) -> None:
    st, start = state
    paths = run_paths(st, f"gone-{fake}")
    paths.dir.mkdir(parents=True)
    atomic_write_json(paths.spec, _cmd(["true"]))
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    me = procfs.stat(os.getpid())
    assert me is not None
    job = {"pid": pid, "start_time": 1, "boot_id": procfs.boot_id()}
    if fake == "other_boot":
        job = {
            "pid": os.getpid(),
            "start_time": me.start_time,
            "boot_id": "11111111-2222-3333-4444-555555555555",
        }
    atomic_write_json(paths.job, job)
    paths.events.write_text(json.dumps({"seq": 1, "ts": 0, "type": "state", "state": "running"}) + "\n")
    agent = start()
    with AgentClient(agent.socket) as c:
        c.result("follow", run=f"gone-{fake}", after_seq=1)
        last = c.wait_for(terminal_event)[-1]["event"]
        assert last["seq"] == 2 and last["state"] == "lost" and "exit" not in last
        assert c.result("status", run=f"gone-{fake}")["state"] == "lost"


def test_second_daemon_on_same_state_dir_refuses(state: Any) -> None:
    st, start = state
    start()
    with pytest.raises(RuntimeError, match="already"):
        start_agent(st, st / "other.sock", args=("--lock-wait-s", "0.3"))


def test_upgrade_handoff_new_daemon_waits_for_the_old_one(state: Any, tmp_path: Path) -> None:
    """The controller's upgrade: `shutdown` to the old daemon, then at once a new one on the same state."""
    _st, start = state
    old = start()
    with AgentClient(old.socket) as c:
        c.result("launch", run="up", spec=_cmd(printer(tmp_path, ["a", "b"], delay=0.5)))
        c.send_raw(b'{"id": 1, "op": "shutdown"}\n')
        new = start()  # may start while the old one is still closing: it waits for the lock
    assert old.proc.wait(10) == 0
    with AgentClient(new.socket) as c:
        c.result("follow", run="up", after_seq=0)
        assert c.wait_for(terminal_event)[-1]["event"]["state"] == "completed"


def test_sigterm_leaves_job_running_and_new_daemon_readopts_it(state: Any, tmp_path: Path) -> None:
    import signal

    _st, start = state
    agent = start()
    lines = [marker("progress", samples_done=i, samples_total=30) for i in range(30)]
    with AgentClient(agent.socket) as c:
        launched = c.result("launch", run="term", spec=_cmd(printer(tmp_path, lines, delay=0.1)))
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    assert procfs.is_same_process(launched["pid"], None, None)
    agent = start()
    with AgentClient(agent.socket) as c:
        assert c.result("status", run="term")["state"] == "running"
        c.result("follow", run="term", after_seq=0)
        events = [m["event"] for m in c.wait_for(terminal_event, timeout=30) if m.get("type") == "event"]
    assert events[-1]["state"] == "completed"
    assert sorted(e["fields"]["samples_done"] for e in events if e.get("kind") == "progress") == list(
        range(30)
    )
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))


def test_damaged_run_dirs_do_not_keep_the_daemon_down(state: Any, tmp_path: Path) -> None:
    st, start = state
    agent = start()
    with AgentClient(agent.socket) as c:
        c.result("launch", run="snap", spec=_cmd(printer(tmp_path, ["one", "two"], delay=0.5)))
    agent.kill()
    paths = run_paths(st, "snap")
    atomic_write_json(paths.cursor, {"offset": 0, "line": 0, "seq": 0, "engine": {"not": "a snapshot"}})
    broken = run_paths(st, "broken")
    broken.dir.mkdir()
    atomic_write_json(broken.spec, _cmd(["true"]))
    broken.events.mkdir()  # the journal cannot even be opened
    agent = start()
    with AgentClient(agent.socket) as c:
        assert [r["run"] for r in c.result("list")["runs"]] == ["snap"]
        c.result("follow", run="snap", after_seq=0)
        events = [m["event"] for m in c.wait_for(terminal_event) if m.get("type") == "event"]
    assert events[-1]["state"] == "completed"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert "cannot adopt run broken" in (st / "daemon.stderr").read_text()
