"""A Slurm array's task ends, held back until the last file's check, survive a daemon SIGKILLed while they
are held: the restarted daemon sends each task's end once, then the final state.  Real one-node Slurm
cluster, real daemon.

The hold is made to last, not raced: once task 0's file is checked, the daemon's checker children are
SIGSTOPped (a check stuck on a slow disk), then task 1 writes its file and both tasks end.  The final state
waits on that check, so the task ends stay held for as long as the test needs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.agentproc import AgentClient, cleanup_runs, start_agent, terminal_event
from tests.helpers.sshd import children_of

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

#: Task 0 writes its capture file at once; task 1 waits for the test's ``go`` file first.
TASK = """
import json, os, struct, sys, time
out, go, t = sys.argv[1], sys.argv[2], os.environ["SLURM_ARRAY_TASK_ID"]
while t == "1" and not os.path.exists(go):
    time.sleep(0.05)
tokens, layers, hidden = 16, 4, 8
ids = struct.pack(f"<{tokens}q", *range(tokens))
size = tokens * layers * hidden * 4
header = {
    "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [0, len(ids)]},
    "hidden_states": {
        "dtype": "F32", "shape": [tokens, layers, hidden], "data_offsets": [len(ids), len(ids) + size]
    },
}
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
tmp = os.path.join(out, f".hs_{t}.tmp")
with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + ids + struct.pack("<f", 1.0) * (size // 4))
os.rename(tmp, os.path.join(out, f"hs_{t}.safetensors"))
print("wrote", t, flush=True)
"""


def _journal(run_dir: Path) -> list[dict[str, Any]]:
    with contextlib.suppress(OSError):
        return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return []


def _shard(event: dict[str, Any]) -> object:
    fields = event.get("fields")
    return fields.get("shard") if isinstance(fields, dict) else None


def _held(run_dir: Path) -> bool:
    """Whether the job is over and task 1's end is seen (sched.json) but not journaled yet (task 0 ended
    while the job ran: its end went out then)."""
    with contextlib.suppress(OSError, ValueError):
        tasks = json.loads((run_dir / "sched.json").read_text()).get("tasks") or {}
        return (
            (run_dir / "exit.json").exists()
            and sorted(tasks.items()) == [("0", "COMPLETED"), ("1", "COMPLETED")]
            and not [e for e in _journal(run_dir) if e.get("kind") == "task_ended" and _shard(e) == 1]
        )
    return False


def _wait(cond: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.02)  # the poll's period (the condition is the run dir's files)


def _checker_children(pid: int) -> list[int]:
    found = []
    for child in children_of(pid):
        with contextlib.suppress(OSError):
            if b"agent.checks.child" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def test_held_task_ends_survive_a_daemon_killed_before_the_final_state(
    slurm_cluster: Path,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    script = tmp_path / "task.py"
    script.write_text(TASK)
    out, go = tmp_path / "cap", tmp_path / "go"
    out.mkdir()
    spec = {
        "name": "held", "host": "cluster", "backend": "command",
        "command": [sys.executable, str(script), str(out), str(go)], "output_dir": str(out),
        "expect": {"layers": 4, "hidden_size": 8},
    }  # fmt: skip
    run_dir = state / "runs" / "h1"
    agent = start_agent(state)
    try:
        with AgentClient(agent.socket) as c:
            c.result("launch", run="h1", spec=spec, scheduler={"kind": "slurm", "gpus": "none", "shards": 2})
        _wait(
            lambda: any(e.get("kind") == "shape_check_passed" for e in _journal(run_dir)),
            "task 0's file checked",
        )
        stuck = _checker_children(agent.pid)
        assert stuck, "the daemon checked task 0's file without a checker child"
        for pid in stuck:
            os.kill(pid, signal.SIGSTOP)  # the next check waits, as on a disk that stopped answering
        go.touch()
        _wait(lambda: _held(run_dir), "task 1's end held")
        agent.kill()  # SIGKILL while the task ends are held (the final state is not journaled yet)
        agent = start_agent(state)
        with AgentClient(agent.socket) as c:
            c.result("follow", run="h1", after_seq=0)
            got = c.wait_for(lambda m: terminal_event(m) and m["run"] == "h1", timeout=120)
        evs = [m["event"] for m in got if m.get("type") == "event"]
    finally:
        agent.kill()
        cleanup_runs(state)
    ended = sorted(e["fields"]["shard"] for e in evs if e.get("kind") == "task_ended")
    assert ended == [0, 1], ended
    assert evs[-1]["state"] == "completed", evs[-3:]
    passed = sorted(e["fields"]["file"] for e in evs if e.get("kind") == "shape_check_passed")
    assert passed == ["hs_0.safetensors", "hs_1.safetensors"], passed
    assert max(e["seq"] for e in evs if e.get("kind") == "task_ended") < evs[-1]["seq"]
    assert [e["seq"] for e in evs] == list(range(1, len(evs) + 1))
