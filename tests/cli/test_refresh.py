"""``runs show``/``runs ls`` without ``serve``: caught up from the host's journal over a real sshd first."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.cli.test_commands import cli
from tests.helpers.sshd import SSHD

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(180)]


def _env(tmp_path: Path, sshd: SSHD) -> dict[str, str]:
    return {
        "EAGLEWATCH_SSH_CONFIG": str(sshd.ssh_config),
        "EAGLEWATCH_KNOWN_HOSTS": str(sshd.known_hosts),
        "EAGLEWATCH_REMOTE_BASE": str(tmp_path / "remote"),
        "EAGLEWATCH_CONNECT_TIMEOUT": "5",
    }


def _start(tmp_path: Path, env: dict[str, str], job: Path, limit: str) -> str:
    res = cli(
        tmp_path, "runs", "start", "--host", "gpu1", "--json", "--",
        "/usr/bin/python3", str(job), str(tmp_path / "stop"), "0.01", limit, extra_env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return str(json.loads(res.stdout)["id"])


def test_show_and_ls_catch_up_from_the_journal_or_say_why_not(
    tmp_path: Path, sshd: SSHD, job_script: Path
) -> None:
    env = _env(tmp_path, sshd)
    add = cli(
        tmp_path, "hosts", "add", "gpu1", "--ssh", sshd.alias, "--python", "/usr/bin/python3",
        "--state-dir", str(tmp_path / "agent"), extra_env=env,
    )  # fmt: skip
    assert add.returncode == 0, add.stderr
    run_id = _start(tmp_path, env, job_script, "5")
    exit_file = tmp_path / "agent" / "runs" / run_id / "exit.json"
    deadline = time.monotonic() + 60
    while not exit_file.exists():
        assert time.monotonic() < deadline, "the job never ended on the host"
        time.sleep(0.1)
    time.sleep(1.0)  # the daemon journals the end shortly after the exit record

    stored = json.loads(cli(tmp_path, "runs", "show", run_id, "--json", "--no-refresh", extra_env=env).stdout)
    assert stored["state"] != "completed" and not [m for m in stored["milestones"] if m["kind"] == "progress"]

    show = cli(tmp_path, "runs", "show", run_id, "--json", extra_env=env)
    assert show.returncode == 0, show.stderr
    detail = json.loads(show.stdout)
    assert detail["state"] == "completed"
    assert [m["fields"]["samples_done"] for m in detail["milestones"] if m["kind"] == "progress"] == [
        0,
        1,
        2,
        3,
        4,
    ]
    log = cli(tmp_path, "runs", "logs", run_id, extra_env=env)
    assert log.stdout.splitlines()[-1] == "job done"

    running = _start(tmp_path, env, job_script, "1000000")
    sshd.stop()
    ls = cli(tmp_path, "runs", "ls", "--json", extra_env=env)
    assert ls.returncode == 0, ls.stderr
    assert {r["id"]: r["state"] for r in json.loads(ls.stdout)}[running] in ("starting", "running")
    assert "host gpu1: not reachable now (" in ls.stderr and "last heard" in ls.stderr
    assert "cannot connect" in ls.stderr
