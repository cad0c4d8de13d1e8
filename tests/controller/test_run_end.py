"""A run ends on the controller within seconds of its job's exit: a real agent over a real sshd.

The jobs stand in for an extraction: a script printing progress lines that exits 0 or 3, and
tests/web/fake_vllm_job.py writing twenty capture files at once just before it exits, so their checks (a
value scan each, numpy in a check child) are still to do when the job ends.  The time of the exit is the
one the agent's job supervisor writes in ``exit.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.spec import parse_spec
from controller.lifecycle import is_terminal
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.helpers.sshd import SSHD

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]
#: The most a run's end may trail its job's exit.
END_WITHIN_S = 5.0
JOB = """\
import json, sys, time
for i in range(4):
    line = {"kind": "progress", "samples_done": i + 1, "samples_total": 4}
    print("EAGLEWATCH " + json.dumps(line), flush=True)
    time.sleep(0.2)
sys.exit(int(sys.argv[1]))
"""
FAKE_VLLM = Path(__file__).parents[1] / "web" / "fake_vllm_job.py"


def _script(tmp_path: Path, code: int) -> dict[str, Any]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return {"command": [sys.executable, str(script), str(code)]}


def _capture(tmp_path: Path) -> dict[str, Any]:
    out = str(tmp_path / "out")
    argv = [sys.executable, str(FAKE_VLLM), out, "--progress", "20", "--delay", "0", "--files", "good"]
    return {"command": argv, "output_dir": out, "expect": {"layers": 2, "hidden_size": 64}}


@pytest.mark.parametrize(
    ("job", "state", "code"),
    [
        (lambda p: _script(p, 0), "completed", 0),
        (lambda p: _script(p, 3), "failed", 3),
        (_capture, "completed", 0),
    ],
    ids=["exit-0", "exit-3", "twenty-files-to-check"],
)
async def test_run_is_terminal_within_seconds_of_its_jobs_exit(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings, job: Any, state: str, code: int
) -> None:
    # The host's Python is this one: the check children find numpy there, as on a host with vLLM.
    host = HostCreate(name="gpu1", ssh="eaglehost", python=sys.executable, state_dir=str(tmp_path / "agent"))
    async with Controller(ssh_settings) as ctl:
        await ctl.add_host(host)
        await wait_for(lambda: _reachable(ctl), what="connection")
        spec = {"host": "gpu1", "backend": "command", "name": "job", **job(tmp_path)}
        run_id = await ctl.create_run(parse_spec(spec))

        async def terminal_at() -> float | None:
            return time.time() if is_terminal((await ctl.get_run(run_id)).state) else None

        seen = await wait_for(terminal_at, timeout=60, what="a terminal state")
        exited = json.loads((tmp_path / "agent" / "runs" / run_id / "exit.json").read_text())["ended_at"]
        run = await ctl.get_run(run_id)
        assert run.state == state and run.exit == {"code": code, "signal": None}
        assert seen - exited < END_WITHIN_S, f"the run ended {seen - exited:.1f} s after its job"
        if spec.get("output_dir"):  # every file was checked before the run ended: its verdict is whole
            checks = [m for m in run.milestones if m.kind in ("shape_check_passed", "shape_check_failed")]
            assert run.verdict == "ok" and len(checks) == 20, (run.verdict_text, len(checks))


async def _reachable(ctl: Controller) -> bool:
    return (await ctl.get_host("gpu1")).reachable is True
