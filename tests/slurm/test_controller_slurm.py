"""A Slurm host through the controller and a real sshd: runs submitted by the agent on the "login node".

The cluster's node is this machine and its CPUs: no GPUs, so the host asks for none (``slurm_gpus``
"none") and the extraction runs the real vLLM CPU engine on a tiny model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.spec import parse_spec
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.extract.jobrun import IN_PROCESS_ENGINE
from tests.helpers.sshd import SSHD

pytestmark = [pytest.mark.slurm, pytest.mark.ssh, pytest.mark.timeout(300)]
#: the engine core in the job's process (jobrun.IN_PROCESS_ENGINE): this test's subject is not vLLM's layout
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    **IN_PROCESS_ENGINE,
}


async def _ended(ctl: Controller, run_id: str) -> bool:
    return (await ctl.get_run(run_id)).state in ("completed", "failed", "stopped", "lost")


def _extraction(tmp_path: Path) -> dict[str, Any]:
    from agent.extract.tinymodel import build

    model = build(tmp_path / "model", "llama", seed=3)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"token_ids": [5 + i, 9, 11, 13][: 2 + i % 3]}) + "\n" for i in range(4))
    )
    return {
        "host": "hpc",
        "name": "tiny",
        "backend": "worker-extension",
        "model": str(model),
        "dataset": str(data),
        "output_dir": str(tmp_path / "out"),
        "batch_size": 2,
        "env": ENGINE_ENV,
        "vllm_args": ["--dtype", "float32"],
        "time_limit_minutes": 10,
    }


@pytest.mark.vllm
@pytest.mark.slow
async def test_runs_on_a_slurm_host_complete_or_time_out(
    tmp_path: Path, slurm_cluster: Path, sshd: SSHD, ssh_settings: Settings
) -> None:
    """One scenario so the runs share the minute Slurm needs to enforce a time limit (its granularity)."""
    async with Controller(ssh_settings) as ctl:
        host = await ctl.add_host(
            HostCreate(
                name="hpc",
                ssh=sshd.alias,
                python=sys.executable,
                state_dir=str(tmp_path / "agent"),
                scheduler="slurm",
                partition="debug",
                sbatch_args=["--cpus-per-task=1"],
                slurm_gpus="none",
            )
        )
        assert (host.scheduler, host.partition, host.sbatch_args) == ("slurm", "debug", ["--cpus-per-task=1"])
        sleeper = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(600)"]
        timeout_id = await ctl.create_run(
            parse_spec(
                {
                    "host": "hpc",
                    "name": "late",
                    "backend": "command",
                    "command": sleeper,
                    "time_limit_minutes": 1,
                }
            )
        )
        hello = [sys.executable, "-c", "import os; print('on', os.environ['SLURM_JOB_PARTITION'])"]
        cmd_id = await ctl.create_run(
            parse_spec({"host": "hpc", "name": "hello", "backend": "command", "command": hello})
        )
        ext_id = await ctl.create_run(parse_spec(_extraction(tmp_path)))
        # A host whose jobs may not start for ten minutes: its run waits in the queue, then is stopped.
        await ctl.add_host(
            HostCreate(
                name="later",
                ssh=sshd.alias,
                python=sys.executable,
                state_dir=str(tmp_path / "agent"),
                scheduler="slurm",
                sbatch_args=["--begin=now+600"],
                slurm_gpus="none",
            )
        )
        held_id = await ctl.create_run(
            parse_spec({"host": "later", "name": "held", "backend": "command", "command": hello})
        )

        async def queued() -> Any:
            run = await ctl.get_run(held_id)
            return run if any(m.kind == "queued" for m in run.milestones) else None

        held = await wait_for(queued, timeout=30, what="queued milestone")
        assert held.state == "pending" and held.scheduler_job and held.scheduler_job.isdigit()
        waiting = next(m for m in held.milestones if m.kind == "queued")
        assert waiting.fields["reason"] == "BeginTime" and "reason BeginTime" in waiting.text
        await ctl.stop_run(held_id)
        stopped = await ctl.get_run(held_id)
        for run_id in (cmd_id, ext_id, timeout_id):
            await wait_for(lambda r=run_id: _ended(ctl, r), timeout=200, what=f"{run_id} ended")
        cmd, ext, late = [await ctl.get_run(r) for r in (cmd_id, ext_id, timeout_id)]
        logs = await ctl.read_log(cmd_id, limit=100)
    assert cmd.state == "completed", cmd.failure_reason
    assert any(line["text"] == "on debug" for line in logs)
    launched = next(m for m in cmd.milestones if m.kind == "launched")
    assert launched.fields["scheduler"] == "slurm" and "--partition=debug" in launched.fields["sbatch"]
    assert ext.state == "completed", ext.failure_reason
    kinds = [m.kind for m in ext.milestones]
    assert "batch_captured" in kinds and "completed" in kinds
    assert sorted(p.name for p in (tmp_path / "out").glob("hs_*.safetensors")) == [
        f"hs_{i}.safetensors" for i in range(4)
    ]
    assert stopped.state == "stopped"
    assert not any(m.kind == "scheduled" for m in stopped.milestones)  # it never ran
    assert late.state == "failed" and (late.failure_reason or "").startswith("TIMEOUT"), late.failure_reason
