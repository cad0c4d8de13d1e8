"""``runs attach`` end to end: the CLI's controller reaches a real agent through a real sshd and watches a job
the test started by hand, by pid and log, with its output dir checked; a missing log is refused first.

The job is tests/web/fake_vllm_job.py, a stand-in for a GPU extraction (no GPU here) that prints vLLM's
milestone lines and writes capture files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_commands import cli
from tests.helpers.sshd import SSHD

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(300)]
FAKE_JOB = Path(__file__).resolve().parents[1] / "web" / "fake_vllm_job.py"


def _show(tmp_path: Path, env: dict[str, str], run: str) -> dict[str, Any]:
    res = cli(tmp_path, "runs", "show", run, "--json", extra_env=env)
    assert res.returncode == 0, res.stderr
    shown: dict[str, Any] = json.loads(res.stdout)
    return shown


def test_runs_attach_over_ssh_watches_a_job_started_by_hand(tmp_path: Path, sshd: SSHD) -> None:
    env = {
        "EAGLEWATCH_SSH_CONFIG": str(sshd.ssh_config),
        "EAGLEWATCH_KNOWN_HOSTS": str(sshd.known_hosts),
        "EAGLEWATCH_REMOTE_BASE": str(tmp_path / "remote"),
    }
    add = cli(
        tmp_path, "hosts", "add", "gpu1", "--ssh", sshd.alias, "--python", sys.executable,
        "--state-dir", str(tmp_path / "agent"), extra_env=env,
    )  # fmt: skip
    assert add.returncode == 0, add.stderr
    out, log, gate = tmp_path / "out", tmp_path / "job.log", tmp_path / "gate"
    out.mkdir()
    gate.write_text("0")
    with open(log, "ab") as fh:
        job = subprocess.Popen(
            [sys.executable, str(FAKE_JOB), str(out), "--progress", "3", "--wait-file", str(gate),
             "--files", "good", "--capture"],
            stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        missing = cli(
            tmp_path, "runs", "attach", "--host", "gpu1", "--pid", str(job.pid),
            "--log", str(tmp_path / "nope.log"), extra_env=env,
        )  # fmt: skip
        assert missing.returncode == 2 and "error: attach.log: log file" in missing.stderr, missing.stderr
        res = cli(
            tmp_path, "runs", "attach", "--host", "gpu1", "--pid", str(job.pid), "--log", str(log),
            "--output-dir", str(out), "--expect-layers", "2", "--expect-hidden-size", "64", "--json",
            extra_env=env,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        run = json.loads(res.stdout)["id"]
        shown = _show(tmp_path, env, run)
        assert shown["state"] == "running" and shown["spec"]["attach"]["pid"] == job.pid
        assert "attached: pid" in cli(tmp_path, "runs", "show", run, extra_env=env).stdout
        gate.write_text("3")
        assert job.wait(60) == 0
        deadline = time.monotonic() + 60
        while shown["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.5)
            shown = _show(tmp_path, env, run)  # each show catches the run up from the host first
        assert (shown["state"], shown["verdict"]) == ("completed", "ok"), shown["verdict_text"]
        assert shown["exit"] == {"code": None, "signal": None}
        kinds = {m["kind"] for m in shown["milestones"]}
        assert {"launched", "engine_ready", "progress", "completed"} <= kinds
        text = cli(tmp_path, "runs", "show", run, extra_env=env).stdout
        assert "exit: unknown" in text and "stop only detaches" in text
        assert len(list(out.glob("hs_*.safetensors"))) == 3 and not shown["problems"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(10)
