"""Slurm hosts through the controller, a real sshd and the real one-node cluster: the agent on the "login
node" submits each run (a sharded run's shards there as one array job, each shard still its own row).

One module-scoped scenario (engine starts and Slurm's one-minute time limit are the cost, so they overlap):
the cluster's node is this machine's CPUs, so the hosts ask for no GPUs and each extraction task runs the
real vLLM CPU engine on the tiny Llama, two samples a shard.
- on host ``hpc`` (partition debug): a command run that completes, and one that overruns its one-minute
  time limit;
- a 3-shard run over ``hpc`` and a plain host: shards 0 and 2 are one array job and complete, shard 1 runs
  on the plain host as an ordinary job;
- on host ``held``, whose jobs may not start for ten minutes (``--begin=now+600``): a command run stopped
  while queued; a 2-shard run whose task 1 is cancelled by hand (``scancel JOB_1``), which fails shard 1
  alone; ``resume --shard 1`` gives it a job of its own (one sbatch), let start at once (``scontrol update
  StartTime=now``), which completes it; stop then scancels the array that still holds shard 0;
- a 2-shard run on ``held`` stopped while queued: one stop, both shards stopped.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from agent.spec import RunSpec, parse_spec
from controller.models import HostCreate, RunDetail
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.extract.jobrun import IN_PROCESS_ENGINE
from tests.helpers.sshd import SSHD, kill_tree_matching

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.ssh,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]
#: the engine core in the job's process (jobrun.IN_PROCESS_ENGINE): this test's subject is not vLLM's layout
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    **IN_PROCESS_ENGINE,
}
TERMINAL = ("completed", "failed", "stopped", "lost")


def _spec(tmp: Path, model: Path, data: Path, out: str, hosts: list[str], shards: int) -> RunSpec:
    return parse_spec({
        "host": hosts, "shards": shards, "name": out, "backend": "worker-extension", "model": str(model),
        "dataset": str(data), "output_dir": str(tmp / out), "batch_size": 2, "env": ENGINE_ENV,
        "vllm_args": ["--dtype", "float32", "--max-num-seqs", "2"], "time_limit_minutes": 10,
    })  # fmt: skip


def _command(host: str, name: str, code: str, **more: Any) -> RunSpec:
    argv = [sys.executable, "-c", code]
    return parse_spec({"host": host, "name": name, "backend": "command", "command": argv, **more})


async def _ended(ctl: Controller, run_id: str) -> RunDetail | None:
    run = await ctl.get_run(run_id)
    return run if run.state in TERMINAL else None


async def _scenario(tmp: Path, settings: Settings, model: Path) -> dict[str, Any]:
    data = tmp / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"token_ids": [5 + i, 9, 11, 13][: 2 + i % 3]}) + "\n" for i in range(6))
    )
    res: dict[str, Any] = {}
    async with Controller(settings) as ctl:
        slurm: dict[str, Any] = {"scheduler": "slurm", "slurm_gpus": "none", "python": sys.executable,
                 "state_dir": str(tmp / "agent")}  # fmt: skip
        res["hpc"] = await ctl.add_host(HostCreate(name="hpc", ssh="eaglehost", partition="debug",
                                        sbatch_args=["--cpus-per-task=1"], **slurm))  # fmt: skip
        # first, so that Slurm's minute runs while everything else does
        late = await ctl.create_run(
            _command("hpc", "late", "import time; print('sleeping', flush=True); time.sleep(600)",
                     time_limit_minutes=1)
        )  # fmt: skip
        hello = await ctl.create_run(
            _command("hpc", "hello", "import os; print('on', os.environ['SLURM_JOB_PARTITION'])")
        )
        await ctl.add_host(HostCreate(name="held", ssh="eaglehost", sbatch_args=["--begin=now+600"], **slurm))
        await ctl.add_host(
            HostCreate(name="plain", ssh="eaglehost2", python=sys.executable, state_dir=str(tmp / "agent"))
        )
        waiting = await ctl.create_run(_command("held", "waiting", "print('never')"))
        mixed = await ctl.create_run(_spec(tmp, model, data, "mixed", ["hpc", "plain"], 3))
        cancel = await ctl.create_run(_spec(tmp, model, data, "cancel", ["held"], 2))
        queued = await ctl.create_run(_spec(tmp, model, data, "queued", ["held"], 2))
        res.update(mixed=mixed, cancel=cancel, queued=queued)

        async def in_queue() -> RunDetail | None:
            run = await ctl.get_run(waiting)
            return run if any(m.kind == "queued" for m in run.milestones) else None

        res["waiting"] = await wait_for(in_queue, timeout=30, what="queued milestone")
        await ctl.stop_run(waiting)
        res["waiting_stopped"] = await ctl.get_run(waiting)

        async def submitted(run_id: str) -> RunDetail | None:
            run = await ctl.get_run(run_id)
            jobs = [s.job_id for s in run.shards or [] if s.task is not None]
            rows = [await ctl.get_run(j) for j in jobs]
            return run if rows and all(r.scheduler_job for r in rows) else None

        for run_id in (mixed, cancel, queued):
            await wait_for(partial(submitted, run_id), timeout=60, what=f"{run_id} submitted")
        # shard 1 of "cancel" is task 1 of its array: cancel that task alone, as an admin would
        first = ((await ctl.get_run(cancel)).shards or [])[0]
        array_job = (await ctl.get_run(first.job_id)).scheduler_job
        res["cancel_array"] = array_job
        subprocess.run(["scancel", f"{array_job}_1"], check=True, timeout=30)

        async def shard_state(run_id: str, idx: int, want: str) -> RunDetail | None:
            run = await ctl.get_run(run_id)
            return run if (run.shards or [])[idx].state == want else None

        res["one_failed"] = await wait_for(
            lambda: shard_state(cancel, 1, "failed"), timeout=60, what="task 1"
        )
        res["alerts"] = await ctl.list_alerts()
        assert await ctl.resume_run(cancel, shard=1) == cancel  # still active: the same run
        res["resumed"] = resumed = await ctl.get_run(cancel)
        new_job = await wait_for(
            lambda: submitted_job(ctl, (resumed.shards or [])[1].job_id),
            timeout=60,
            what="the shard's own sbatch",
        )
        res["new_job"] = new_job
        subprocess.run(["scontrol", "update", f"JobId={new_job}", "StartTime=now"], check=True, timeout=30)
        res["mixed_end"] = await wait_for(lambda: _ended(ctl, mixed), timeout=400, what="mixed run ended")
        res["shard1_done"] = await wait_for(
            lambda: shard_state(cancel, 1, "completed"), timeout=300, what="resumed shard 1 completed"
        )
        res["stop_cancel"] = await ctl.stop_job(cancel)
        res["stop_queued"] = await ctl.stop_job(queued)
        res["cancel_end"] = await wait_for(lambda: _ended(ctl, cancel), timeout=60, what="cancel run ended")
        res["queued_end"] = await wait_for(lambda: _ended(ctl, queued), timeout=60, what="queued run ended")
        res["queued_array"] = (await ctl.get_run(res["queued_end"].shards[0].job_id)).scheduler_job
        res["hello_end"] = await wait_for(lambda: _ended(ctl, hello), timeout=60, what="hello ended")
        res["hello_log"] = await ctl.read_log(hello, limit=100)
        res["late_end"] = await wait_for(lambda: _ended(ctl, late), timeout=200, what="late run timed out")
    return res


async def submitted_job(ctl: Controller, job_id: str) -> str | None:
    """The Slurm job id of a job row once its sbatch has answered (an AssertionError if its launch failed)."""
    job = await ctl.get_run(job_id)
    assert job.state != "failed", job.failure_reason
    return job.scheduler_job or None


@pytest.fixture(scope="module")
def scenario(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, slurm_cluster: Path
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sharded-slurm")
    sshd = SSHD.start(tmp / "sshd")
    sshd.ssh_config.write_text(
        sshd.ssh_config.read_text() + sshd.ssh_config.read_text().replace("Host eaglehost", "Host eaglehost2")
    )
    settings = Settings(
        home=tmp / "home", known_hosts=sshd.known_hosts, ssh_config=sshd.ssh_config,
        remote_base=str(tmp / "remote"), reconnect_initial_s=0.1, reconnect_max_s=0.5, connect_timeout=5,
        keepalive_interval=2,
    )  # fmt: skip
    try:
        yield {"tmp": tmp, **asyncio.run(_scenario(tmp, settings, tiny_llama))}
    finally:
        kill_tree_matching(str(tmp) + "/")
        sshd.stop()


def test_command_runs_complete_time_out_or_wait_in_the_queue(scenario: dict[str, Any]) -> None:
    host = scenario["hpc"]
    assert (host.scheduler, host.partition, host.sbatch_args) == ("slurm", "debug", ["--cpus-per-task=1"])
    hello: RunDetail = scenario["hello_end"]
    assert hello.state == "completed", hello.failure_reason
    assert any(line["text"] == "on debug" for line in scenario["hello_log"])
    launched = next(m for m in hello.milestones if m.kind == "launched")
    assert launched.fields["scheduler"] == "slurm" and "--partition=debug" in launched.fields["sbatch"]
    late: RunDetail = scenario["late_end"]
    assert late.state == "failed" and (late.failure_reason or "").startswith("TIMEOUT"), late.failure_reason
    waiting: RunDetail = scenario["waiting"]
    assert waiting.state == "pending" and waiting.scheduler_job and waiting.scheduler_job.isdigit()
    queued = next(m for m in waiting.milestones if m.kind == "queued")
    assert queued.fields["reason"] == "BeginTime" and "reason BeginTime" in queued.text
    stopped: RunDetail = scenario["waiting_stopped"]
    assert stopped.state == "stopped"
    assert not any(m.kind == "scheduled" for m in stopped.milestones)  # it never ran


def test_a_slurm_hosts_shards_are_one_array_job_that_completes_them(scenario: dict[str, Any]) -> None:
    run: RunDetail = scenario["mixed_end"]
    assert run.state == "completed", run.failure_reason
    shards = run.shards or []
    assert [(s.index, s.host, s.task, s.state) for s in shards] == [
        (0, "hpc", 0, "completed"), (1, "plain", None, "completed"), (2, "hpc", 2, "completed")
    ]  # fmt: skip
    assert shards[0].job_id == shards[2].job_id != shards[1].job_id  # one array job for both, one sbatch
    launched = [m for m in run.milestones if m.kind == "launched" and m.fields.get("scheduler") == "slurm"]
    assert len(launched) == 1 and "--array=0,2" in launched[0].fields["sbatch"]
    assert {m.shard for m in run.milestones if m.kind == "task_ended"} == {0, 2}
    # the array job's last word on its tasks comes after the check of every file they wrote
    array_files = {f"hs_{i}.safetensors" for i in (0, 1, 4, 5)}
    checked = [
        m for m in run.milestones if m.kind == "shape_check_passed" and m.fields["file"] in array_files
    ]
    assert {m.fields["file"] for m in checked} == array_files
    assert max(m.at for m in checked) <= max(m.at for m in run.milestones if m.kind == "task_ended")
    assert {"batch_captured", "completed"} <= {m.kind for m in run.milestones}
    assert all(s.progress and s.progress.get("samples_done") == 2 for s in shards)
    files = sorted(p.name for p in (scenario["tmp"] / "mixed").glob("hs_*.safetensors"))
    assert files == [f"hs_{i}.safetensors" for i in range(6)]


def test_a_cancelled_task_fails_its_shard_alone_and_resume_gives_it_its_own_job(
    scenario: dict[str, Any],
) -> None:
    failed = scenario["one_failed"]
    assert [s.state for s in failed.shards] == ["pending", "failed"]
    assert failed.state == "pending"  # shard 0 still waits: the run goes on
    assert (failed.shards[1].failure_reason or "").startswith("CANCELLED"), failed.shards[1]
    (alert,) = [a for a in scenario["alerts"] if a.rule == "run_failed" and "cancel shard 1/2" in a.message]
    assert "CANCELLED" in alert.message and alert.run_id == failed.shards[1].job_id
    resumed = scenario["resumed"].shards[1]
    assert resumed.task is None and resumed.attempts == 2 and resumed.job_id.endswith("-s1-a2")
    assert scenario["new_job"] != scenario["cancel_array"]
    done = scenario["shard1_done"]
    assert [s.state for s in done.shards] == ["pending", "completed"]
    out = sorted(p.name for p in (scenario["tmp"] / "cancel").glob("hs_*.safetensors"))
    assert out == ["hs_3.safetensors", "hs_4.safetensors", "hs_5.safetensors"]  # shard 1 of 2: samples 3-5
    end = scenario["cancel_end"]
    assert scenario["stop_cancel"]["stopped"] == [0]
    assert [s.state for s in end.shards] == ["stopped", "completed"] and end.state == "stopped"


def test_stop_scancels_the_whole_array_once(scenario: dict[str, Any]) -> None:
    end = scenario["queued_end"]
    assert scenario["stop_queued"]["stopped"] == [0, 1]
    assert end.state == "stopped" and [s.state for s in end.shards] == ["stopped", "stopped"]
    assert len({s.job_id for s in end.shards}) == 1
    left = subprocess.run(
        ["squeue", "-h", "-j", scenario["queued_array"], "-o", "%T"], capture_output=True, text=True
    )
    assert "PENDING" not in left.stdout and "RUNNING" not in left.stdout
