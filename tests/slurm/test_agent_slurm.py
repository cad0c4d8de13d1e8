"""Runs submitted to a real Slurm cluster by the real agent daemon (over its socket): end, array, stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.agentproc import AgentClient, AgentProc, cleanup_runs, start_agent, terminal_event

pytestmark = [pytest.mark.slurm]
SLURM = {"kind": "slurm", "gpus": "none"}


@pytest.fixture
def daemon(slurm_cluster: Path, tmp_path: Path) -> Any:
    """An agent daemon whose state dir (and so every job's log) is on the cluster's shared filesystem."""
    agent = start_agent(tmp_path / "state")
    try:
        yield agent
    finally:
        agent.kill()
        cleanup_runs(tmp_path / "state")


def _command(argv: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": "sl", "host": "cluster", "backend": "command", "command": argv, **extra}


def _events(c: AgentClient, run: str, timeout: float = 60) -> list[dict[str, Any]]:
    c.result("follow", run=run, after_seq=0)
    got = c.wait_for(lambda m: terminal_event(m) and m["run"] == run, timeout=timeout)
    return [m["event"] for m in got if m.get("type") == "event" and m.get("run") == run]


def test_a_command_job_runs_as_a_slurm_job_and_completes(daemon: AgentProc, tmp_path: Path) -> None:
    script = (
        "import os; print('hello from', os.environ['SLURM_JOB_ID']);"
        'print(\'EAGLEWATCH {"kind": "progress", "samples_done": 1}\')'
    )
    with AgentClient(daemon.socket) as c:
        res = c.result("launch", run="c1", spec=_command([sys.executable, "-c", script]), scheduler=SLURM)
        assert res["scheduler"] == "slurm" and res["job_id"].isdigit()
        evs = _events(c, "c1")
        status = c.result("status", run="c1")
    assert evs[-1]["state"] == "completed", evs[-3:]
    launched = next(e for e in evs if e.get("kind") == "launched")
    assert launched["fields"]["job_id"] == res["job_id"]
    assert any(e.get("kind") == "progress" for e in evs)
    log = (daemon.state_dir / "runs" / "c1" / "output.log").read_text()
    assert f"hello from {res['job_id']}" in log
    assert status["scheduler"]["state"] == "COMPLETED"


def test_a_two_shard_array_completes_both_tasks_with_milestones_per_shard(
    daemon: AgentProc, tmp_path: Path
) -> None:
    script = (
        "import os; t = os.environ['SLURM_ARRAY_TASK_ID']; print('task', t, os.environ['EAGLEWATCH_SHARD']);"
        'print(\'EAGLEWATCH {"kind": "progress", "samples_done": \' + t + \'}\')'
    )
    with AgentClient(daemon.socket) as c:
        res = c.result(
            "launch",
            run="a1",
            spec=_command([sys.executable, "-c", script]),
            scheduler={**SLURM, "shards": 2},
        )
        evs = _events(c, "a1")
    assert evs[-1]["state"] == "completed", evs[-3:]
    run_dir = daemon.state_dir / "runs" / "a1"
    log = (run_dir / "output.log").read_text().splitlines()
    assert "[shard 0] task 0 0/2" in log and "[shard 1] task 1 1/2" in log
    progress = sorted(e["fields"]["shard"] for e in evs if e.get("kind") == "progress")
    assert progress == [0, 1]
    ended = [e for e in evs if e.get("type") == "state"][-1]
    assert ended["reason"] == "exit code 0"
    assert json.loads((run_dir / "sched.json").read_text())["tasks"] == {"0": "COMPLETED", "1": "COMPLETED"}
    assert res["job_id"].isdigit()


def test_stop_scancels_the_whole_array_and_confirms(daemon: AgentProc, tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
    with AgentClient(daemon.socket) as c:
        res = c.result("launch", run="s1", spec=_command(argv), scheduler={**SLURM, "shards": 2})
        c.result("follow", run="s1", after_seq=0)
        c.wait_for(lambda m: m.get("type") == "event" and m["event"].get("kind") == "scheduled", timeout=30)
        stop = c.result("stop", run="s1", grace_s=1)
        evs = _events(c, "s1")
    assert stop["confirmed"] is True and stop["scheduler_state"] == "CANCELLED", stop
    assert evs[-1]["state"] == "stopped"
    left = subprocess.run(["squeue", "-h", "-j", res["job_id"]], capture_output=True, text=True)
    assert "RUNNING" not in left.stdout and "PENDING" not in left.stdout


def test_sbatch_refusing_a_partition_fails_the_launch_naming_it(daemon: AgentProc) -> None:
    with AgentClient(daemon.socket) as c:
        err = c.request(
            "launch", run="p1", spec=_command(["true"]), scheduler={**SLURM, "partition": "nosuchpart"}
        )
        evs = _events(c, "p1")
    assert err["code"] == "failed" and "sbatch refused the job" in err["message"]
    assert "invalid partition" in err["message"].lower()
    assert evs[-1]["state"] == "failed" and "sbatch refused" in evs[-1]["reason"]


def test_a_restarted_agent_re_adopts_the_job_by_its_id(slurm_cluster: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = start_agent(state)
    argv = [sys.executable, "-c", "import time; print('first', flush=True); time.sleep(5); print('second')"]
    try:
        with AgentClient(agent.socket) as c:
            res = c.result("launch", run="r1", spec=_command(argv), scheduler=SLURM)
            c.result("follow", run="r1", after_seq=0)
            c.wait_for(
                lambda m: m.get("type") == "event" and m["event"].get("kind") == "scheduled", timeout=30
            )
        agent.kill()  # SIGKILL mid-job: the Slurm job does not notice
        agent = start_agent(state)
        with AgentClient(agent.socket) as c:
            evs = _events(c, "r1")
    finally:
        agent.kill()
        cleanup_runs(state)
    assert evs[-1]["state"] == "completed", evs[-3:]
    assert [e["seq"] for e in evs] == list(range(1, len(evs) + 1))  # nothing journaled twice
    assert sum(1 for e in evs if e.get("kind") == "scheduled") == 1
    assert "second" in (state / "runs" / "r1" / "output.log").read_text()
    assert res["job_id"].isdigit()


def test_slurm_out_of_reach_is_named(tmp_path: Path) -> None:
    """No cluster needed: a daemon whose Slurm config names a controller port nobody listens on."""
    conf = tmp_path / "dead.conf"
    conf.write_text(
        "ClusterName=dead\nSlurmctldHost=localhost\nSlurmctldPort=9\nMessageTimeout=2\n"
        "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=ALL Default=YES\n"
    )
    agent = start_agent(tmp_path / "state", env={"SLURM_CONF": str(conf)})
    try:
        with AgentClient(agent.socket) as c:
            err = c.request("launch", run="u1", spec=_command(["true"]), scheduler=SLURM)
    finally:
        agent.kill()
    assert err["code"] == "failed" and "Slurm is not reachable" in err["message"], err


def test_one_squeue_per_interval_answers_for_every_run(slurm_cluster: Path, tmp_path: Path) -> None:
    """A counting wrapper in front of the real squeue (it logs each call, then execs squeue)."""
    shim = tmp_path / "bin"
    shim.mkdir()
    calls = tmp_path / "squeue.calls"
    (shim / "squeue").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec /usr/bin/squeue "$@"\n')
    (shim / "squeue").chmod(0o755)
    env = {"PATH": f"{shim}:{os.environ['PATH']}", "EAGLEWATCH_SLURM_POLL_S": "2"}
    agent = start_agent(tmp_path / "state", env=env)
    argv = [sys.executable, "-c", "import time; time.sleep(5)"]
    try:
        with AgentClient(agent.socket) as c:
            started = time.monotonic()
            for run in ("q1", "q2", "q3"):
                c.result("launch", run=run, spec=_command(argv), scheduler=SLURM)
            ends = [_events(c, run)[-1]["state"] for run in ("q1", "q2", "q3")]
            elapsed = time.monotonic() - started
    finally:
        agent.kill()
        cleanup_runs(tmp_path / "state")
    assert ends == ["completed"] * 3
    n = len(calls.read_text().splitlines())
    assert 2 <= n <= elapsed / 2 + 1, (n, elapsed)


def test_a_job_gone_from_squeue_and_sacct_is_lost(slurm_cluster: Path, tmp_path: Path) -> None:
    """The daemon comes back to a job id Slurm no longer knows (this cluster keeps no accounting)."""
    state = tmp_path / "state"
    agent = start_agent(state)
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        with AgentClient(agent.socket) as c:
            res = c.result("launch", run="g1", spec=_command(argv), scheduler=SLURM)
        agent.kill()
        subprocess.run(["scancel", res["job_id"]], check=True)
        job_file = state / "runs" / "g1" / "job.json"
        job = json.loads(job_file.read_text())
        job_file.write_text(json.dumps({**job, "job_id": "999999"}))  # an id squeue and sacct never knew
        agent = start_agent(state)
        with AgentClient(agent.socket) as c:
            evs = _events(c, "g1", timeout=40)
    finally:
        agent.kill()
        cleanup_runs(state)
    assert evs[-1]["state"] == "lost", evs[-3:]
    assert json.loads((state / "runs" / "g1" / "sched.json").read_text())["vanished"] is True
