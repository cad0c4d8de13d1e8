"""A Slurm array's task ends, held back until the last file's check, survive a daemon SIGKILLed while they
are held: the restarted daemon sends each task's end once, then the final state.  Real one-node Slurm
cluster, real daemon."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.agentproc import AgentClient, cleanup_runs, start_agent, terminal_event
from tests.slurm.conftest import slurm_cluster

__all__ = ["slurm_cluster"]

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

#: Each task writes one 800 MB float32 capture file (ones) and exits: its value scan outlasts the job, so
#: the scheduler's task ends arrive while the last checks run.
TASK = """
import json, os, struct, sys
out, t = sys.argv[1], os.environ["SLURM_ARRAY_TASK_ID"]
tokens, layers, hidden = 2000, 4, 25000
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
chunk = struct.pack("<f", 1.0) * (1 << 22)
tmp = os.path.join(out, f".hs_{t}.tmp")
with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + ids)
    for _ in range(size // len(chunk)):
        f.write(chunk)
    f.write(chunk[: size % len(chunk)])
os.rename(tmp, os.path.join(out, f"hs_{t}.safetensors"))
print("wrote", t, flush=True)
"""


def _held(run_dir: Path) -> bool:
    """Whether the job is over and Slurm's task ends are seen (sched.json) but not journaled yet."""
    with contextlib.suppress(OSError, ValueError):
        tasks = json.loads((run_dir / "sched.json").read_text()).get("tasks") or {}
        journal = (run_dir / "events.jsonl").read_text()
        return (
            (run_dir / "exit.json").exists()
            and sorted(tasks.items()) == [("0", "COMPLETED"), ("1", "COMPLETED")]
            and "task_ended" not in journal  # held: they go out just before the final state
        )
    return False


def test_held_task_ends_survive_a_daemon_killed_before_the_final_state(
    slurm_cluster: Path,
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    script = tmp_path / "task.py"
    script.write_text(TASK)
    out = tmp_path / "cap"
    out.mkdir()
    spec = {
        "name": "held", "host": "cluster", "backend": "command",
        "command": [sys.executable, str(script), str(out)], "output_dir": str(out),
        "expect": {"layers": 4, "hidden_size": 25000},
    }  # fmt: skip
    run_dir = state / "runs" / "h1"
    agent = start_agent(state)
    try:
        with AgentClient(agent.socket) as c:
            c.result("launch", run="h1", spec=spec, scheduler={"kind": "slurm", "gpus": "none", "shards": 2})
        deadline = time.monotonic() + 200
        while not _held(run_dir) and time.monotonic() < deadline:
            time.sleep(0.02)  # the poll's period (the condition is the run dir's files)
        assert _held(run_dir), "the task ends were never held"
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
    assert max(e["seq"] for e in evs if e.get("kind") == "task_ended") < evs[-1]["seq"]
    assert [e["seq"] for e in evs] == list(range(1, len(evs) + 1))
