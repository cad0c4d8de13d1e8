"""Attach to a Slurm job the user submitted by hand (real one-node Slurm, real agent daemon): followed through
the scheduler with its log, its exit status recorded from Slurm; stop without allow_stop leaves it queued."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.agentjobs import marker
from tests.helpers.agentproc import AgentClient, AgentProc, cleanup_runs, start_agent, terminal_event

pytestmark = [pytest.mark.slurm]


@pytest.fixture
def daemon(slurm_cluster: Path, tmp_path: Path) -> Any:
    """An agent daemon on the cluster's login node (this machine)."""
    agent = start_agent(tmp_path / "state")
    try:
        yield agent
    finally:
        agent.kill()
        cleanup_runs(tmp_path / "state")


def _sbatch(tmp_path: Path, log: Path, script: str) -> str:
    """Submit ``script`` (Python) as the user would, outside eaglewatch; its job id."""
    path = tmp_path / "job.py"
    path.write_text(script)
    argv = [
        "sbatch",
        "--parsable",
        f"--output={log}",
        f"--chdir={tmp_path}",
        f"--wrap={sys.executable} {path}",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    return out.strip().split(";")[0]


def test_a_slurm_job_submitted_by_hand_is_followed_to_its_exit_code(
    daemon: AgentProc, tmp_path: Path
) -> None:
    log = tmp_path / "slurm.log"
    lines = [marker("progress", samples_done=1, samples_total=2), marker("progress", samples_done=2)]
    job = _sbatch(
        tmp_path, log, f"import sys, time\ntime.sleep(1)\nprint(*{lines!r}, sep='\\n')\nsys.exit(3)\n"
    )
    log.touch()  # the job may not have started yet: its log is there for the attach to find
    spec = {"name": "sl", "host": "cluster", "attach": {"slurm_job": job, "log": str(log)}}
    with AgentClient(daemon.socket) as c:
        assert c.result("launch", run="s1", spec=spec)["attached"] is True
        c.result("follow", run="s1", after_seq=0)
        events = [m["event"] for m in c.wait_for(terminal_event, timeout=90) if m.get("type") == "event"]
    assert [e["fields"]["samples_done"] for e in events if e.get("kind") == "progress"] == [1, 2]
    assert events[-1]["state"] == "failed" and events[-1]["exit"]["code"] == 3, events[-3:]


def test_stop_without_allow_stop_leaves_the_slurm_job_alone(daemon: AgentProc, tmp_path: Path) -> None:
    job = _sbatch(tmp_path, tmp_path / "slurm.log", "import time\ntime.sleep(600)\n")
    with AgentClient(daemon.socket) as c:
        c.result("launch", run="s2", spec={"name": "sl", "host": "cluster", "attach": {"slurm_job": job}})
        assert c.result("stop", run="s2")["detached"] is True
        assert c.result("status", run="s2")["state"] == "stopped"
    queue = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30
    )
    assert queue.stdout.strip() in ("PENDING", "RUNNING", "CONFIGURING")
    subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
