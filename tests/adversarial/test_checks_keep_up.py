"""Checks keep up: every file checked and the verdict final within seconds, no stall while checks advance."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.paths import read_json, run_paths
from agent.spec import parse_spec
from controller import alerts
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon, terminal_event
from tests.helpers.sshd import kill_tree_matching

__all__ = ["agent_daemon"]

pytestmark = pytest.mark.timeout(120)

RUN = {"id": "r-1", "name": "llama", "host": "gpu1", "state": "running"}


@pytest.fixture
def reap(tmp_path: Path) -> Iterator[None]:
    """Kill every process (daemon, bridge, job) whose cmdline or environment names this test's tmp dir."""
    yield
    kill_tree_matching(str(tmp_path) + "/")


FILES = 1500

#: A job that writes FILES small real safetensors files (4 layers × 16 wide, bf16 ones) but hs_1000, and
#: exits; hs_7 holds an all-zero layer, so the value scan (a child's work) must run on every file.
MANY_WRITER = """
import json, os, struct, sys
out, n = sys.argv[1], int(sys.argv[2])
tokens = 3
ids = struct.pack("<3q", 1, 2, 3)
ones = struct.pack("<H", 0x3F80) * (tokens * 4 * 16)
zero_layer = (struct.pack("<H", 0x3F80) * (16 * 3) + bytes(16 * 2)) * tokens
def blob(hs):
    header = {
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [0, len(ids)]},
        "hidden_states": {
            "dtype": "BF16", "shape": [tokens, 4, 16], "data_offsets": [len(ids), len(ids) + len(hs)]
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + ids + hs
for i in (i for i in range(n) if i != 1000):
    tmp = os.path.join(out, f".hs_{i}.tmp")
    with open(tmp, "wb") as f:
        f.write(blob(zero_layer if i == 7 else ones))
    os.rename(tmp, os.path.join(out, f"hs_{i}.safetensors"))
print("wrote", n, flush=True)
"""


def _events(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["event"] for m in msgs if m.get("type") == "event"]


def test_every_file_is_checked_within_seconds_and_the_verdict_comes_last(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    script = tmp_path / "writer.py"
    script.write_text(MANY_WRITER)
    out = tmp_path / "cap"
    out.mkdir()
    spec = {
        "name": "many",
        "host": "local",
        "backend": "command",
        "command": [sys.executable, str(script), str(out), str(FILES)],
        "output_dir": str(out),
        "expect": {"layers": 4, "hidden_size": 16},
    }
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="many", spec=spec)
        c.result("follow", run="many", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=90))
    ended_at = read_json(run_paths(agent_daemon.state_dir, "many").exit)["ended_at"]
    checks = [e for e in events if e["type"] == "check"]
    written = sorted(f"hs_{i}.safetensors" for i in range(FILES) if i != 1000)
    assert sorted(e["file"] for e in checks) == sorted([*written, "."])  # ".": the index gaps
    failed = [e for e in events if e.get("kind") == "shape_check_failed"]
    assert sorted((f["fields"]["file"], f["fields"]["code"]) for f in failed) == [
        (str(out), "index_gap"),
        (str(out / "hs_7.safetensors"), "all_zero"),
    ]
    assert sum(e.get("kind") == "shape_check_passed" for e in events) == FILES - 2
    final = events[-1]
    assert final["type"] == "state" and final["state"] == "completed"
    assert max(e["seq"] for e in checks) < final["seq"]  # the verdict waits for the last check
    assert final["ts"] - ended_at < 5.0, "the verdict came more than 5 s after the job's exit"


#: Progress lines 50 ms apart, then FILES capture files over about 10 s with no progress line (a plain line
#: every 100 files), then exit: the files and their checks are all that advances.
TRICKLE_WRITER = """
import json, os, struct, sys, time
out, n = sys.argv[1], int(sys.argv[2])
for i in range(10):
    print('EAGLEWATCH ' + json.dumps({'kind': 'progress', 'samples_done': i}), flush=True)
    time.sleep(0.05)
ids = struct.pack("<3q", 1, 2, 3)
hs = struct.pack("<H", 0x3F80) * (3 * 4 * 16)
header = {
    "token_ids": {"dtype": "I64", "shape": [3], "data_offsets": [0, 24]},
    "hidden_states": {"dtype": "BF16", "shape": [3, 4, 16], "data_offsets": [24, 24 + len(hs)]},
}
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
blob = struct.pack("<Q", len(raw)) + raw + ids + hs
start = time.monotonic()
for i in range(n):
    with open(os.path.join(out, f".hs_{i}.tmp"), "wb") as f:
        f.write(blob)
    os.rename(os.path.join(out, f".hs_{i}.tmp"), os.path.join(out, f"hs_{i}.safetensors"))
    if i % 100 == 99:
        print("wrote", i + 1, flush=True)
    time.sleep(max(0.0, start + 10.0 * (i + 1) / n - time.monotonic()))
"""


async def test_no_stall_while_files_are_written_and_checked(tmp_path: Path, reap: None) -> None:
    settings = Settings(home=tmp_path / "home", stall_factor=3, stall_min_s=6.0, sweep_interval_s=0.2)
    files = 1500
    script = tmp_path / "writer.py"
    script.write_text(TRICKLE_WRITER)
    out = tmp_path / "cap"
    out.mkdir()
    async with Controller(settings) as ctl:
        await ctl.add_host(HostCreate(name="loc", ssh="local", state_dir=str(tmp_path / "agent")))
        spec = {
            "host": "loc",
            "backend": "command",
            "command": [sys.executable, str(script), str(out), str(files)],
            "output_dir": str(out),
            "expect": {"layers": 4, "hidden_size": 16},
        }
        run_id = await ctl.create_run(parse_spec(spec))

        async def ended() -> bool:
            return (await ctl.get_run(run_id)).state == "completed"

        await wait_for(ended, timeout=60, what="the run's end")
        run = await ctl.get_run(run_id)
        assert [a.message for a in run.alerts] == []
        assert sum(m.kind == "shape_check_passed" for m in run.milestones) == files


@pytest.mark.parametrize(("check_ago", "fires"), [(None, True), (30, False), (100, True)])
def test_a_recent_check_counts_as_progress(check_ago: float | None, fires: bool) -> None:
    now = 10_000.0
    run = {**RUN, "state": "running", "last_progress_at": now - 100, "progress_interval_s": 10}
    run["last_check_at"] = None if check_ago is None else now - check_ago
    assert (alerts.stall(run, now, factor=5, min_s=60) is not None) == fires


def _check_children(daemon_pid: int) -> int:
    """The daemon's live check children (``python -m agent.checks.child`` whose parent is the daemon)."""
    count = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        count += ppid == daemon_pid and b"agent.checks.child" in cmdline
    return count


def test_eight_concurrent_runs_share_the_daemons_bounded_check_children(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    """Eight runs whose every file needs a child's value scan: the daemon never holds more than its one
    pool's bound of check children (a pool per run held two per run)."""
    from agent.checks.child import pool_size

    script = tmp_path / "writer.py"
    script.write_text(MANY_WRITER)
    runs = [f"r{i}" for i in range(8)]
    seen = 0
    with AgentClient(agent_daemon.socket) as c:
        for run in runs:
            out = tmp_path / run
            out.mkdir()
            spec = {
                "name": run, "host": "local", "backend": "command",
                "command": [sys.executable, str(script), str(out), "300"], "output_dir": str(out),
                "expect": {"layers": 4, "hidden_size": 16},
            }  # fmt: skip
            c.result("launch", run=run, spec=spec)
        ended: dict[str, str] = {}
        deadline = time.monotonic() + 100
        while len(ended) < len(runs) and time.monotonic() < deadline:
            seen = max(seen, _check_children(agent_daemon.pid))
            for run in runs:
                state = c.result("status", run=run).get("state")
                if state in ("completed", "failed", "stopped", "lost"):
                    ended[run] = state
        assert ended == dict.fromkeys(runs, "completed"), ended
    assert 1 <= seen <= pool_size(), f"{seen} check children at once, the bound is {pool_size()}"
