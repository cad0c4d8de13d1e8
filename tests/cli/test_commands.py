"""The ``eaglewatch`` CLI as a real subprocess (``python -m cli``) on a tmp EAGLEWATCH_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import agent
from tests.helpers.sshd import SSHD

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def cli(
    tmp_path: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        EAGLEWATCH_HOME=str(tmp_path / "home"),
        COLUMNS="200",
        **(extra_env or {}),
    )
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_version(tmp_path: Path) -> None:
    res = cli(tmp_path, "--version")
    assert res.returncode == 0 and res.stdout.strip() == f"eaglewatch {agent.__version__}"


@pytest.mark.slow
def test_hosts_runs_logs_alerts(tmp_path: Path, reap: None, job_script: Path) -> None:
    res = cli(tmp_path, "hosts", "add", "loc", "--ssh", "local", "--state-dir", str(tmp_path / "agent"))
    assert res.returncode == 0, res.stderr
    assert "added host loc" in res.stdout and "connected: agent" in res.stdout
    dup = cli(tmp_path, "hosts", "add", "loc", "--ssh", "local")
    assert dup.returncode == 1 and "already exists" in dup.stderr
    hosts = json.loads(cli(tmp_path, "hosts", "ls", "--json").stdout)
    assert [(h["name"], h["reachable"]) for h in hosts] == [("loc", True)]
    check = cli(tmp_path, "hosts", "check", "loc")
    assert check.returncode == 0, check.stderr
    assert "loc: reachable" in check.stdout and "link: local-pipes" in check.stdout

    start = cli(
        tmp_path,
        "runs",
        "start",
        "--host",
        "loc",
        "--json",
        "--",
        sys.executable,
        str(job_script),
        str(tmp_path / "stop"),
        "0.01",
        "5",
    )
    assert start.returncode == 0, start.stderr
    run_id = json.loads(start.stdout)["id"]
    follow = cli(tmp_path, "runs", "logs", run_id, "-f")
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout.splitlines()[-1] == "job done" and "plain line 4" in follow.stdout
    assert "completed" in follow.stderr
    show = json.loads(cli(tmp_path, "runs", "show", run_id, "--json").stdout)
    assert show["id"] == run_id and show["state"] == "completed" and show["spec"]["backend"] == "command"
    assert {"milestones", "alerts", "problems", "progress", "exit"} <= show.keys()
    assert [m["fields"]["samples_done"] for m in show["milestones"] if m["kind"] == "progress"] == list(
        range(5)
    )
    listed = json.loads(cli(tmp_path, "runs", "ls", "--json").stdout)
    assert [r["id"] for r in listed] == [run_id]
    logs = cli(tmp_path, "runs", "logs", run_id)
    assert logs.stdout.splitlines()[0] == "progress: 0 samples" and logs.stdout.splitlines()[-1] == "job done"
    raw = cli(tmp_path, "runs", "logs", run_id, "--raw")
    assert raw.stdout.splitlines()[0].startswith("EAGLEWATCH ") and raw.stdout.splitlines()[-1] == "job done"
    assert json.loads(cli(tmp_path, "alerts", "ls", "--json").stdout) == []
    stop = cli(tmp_path, "runs", "stop", run_id)
    assert stop.returncode == 1 and "already completed" in stop.stderr
    rm = cli(tmp_path, "hosts", "rm", "loc")
    assert rm.returncode == 0 and json.loads(cli(tmp_path, "hosts", "ls", "--json").stdout) == []


def test_runs_start_from_spec_file_and_bad_input(tmp_path: Path, reap: None) -> None:
    assert (
        cli(
            tmp_path, "hosts", "add", "loc", "--ssh", "local", "--state-dir", str(tmp_path / "agent")
        ).returncode
        == 0
    )
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {"backend": "command", "command": [sys.executable, "-c", "print('hi')"], "name": "from-file"}
        )
    )
    res = cli(tmp_path, "runs", "start", "--host", "loc", "--spec", str(spec))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith("r-")
    bad = cli(tmp_path, "runs", "start", "--host", "loc", "--tp", "0", "--", "true")
    assert bad.returncode == 2 and "tensor_parallel_size" in bad.stderr
    env_bad = cli(tmp_path, "runs", "start", "--host", "loc", "--env", "NOEQUALS", "--", "true")
    assert env_bad.returncode == 2 and "KEY=VALUE" in env_bad.stderr
    unknown = cli(tmp_path, "runs", "start", "--host", "ghost", "--", "true")
    assert unknown.returncode == 2 and "no host named 'ghost'" in unknown.stderr
    missing = cli(tmp_path, "runs", "show", "r-missing")
    assert missing.returncode == 1 and "no run" in missing.stderr
    badhost = cli(tmp_path, "hosts", "add", "x", "--ssh", "-oProxyCommand=evil")
    assert badhost.returncode == 2 and "ssh" in badhost.stderr


def test_runs_start_refuses_a_repeated_env_option(tmp_path: Path) -> None:
    res = cli(tmp_path, "runs", "start", "--host", "ghost", "--env", "A=1", "--env", "A=2", "--", "true")
    assert res.returncode == 2 and "--env A given more than once" in res.stderr


@pytest.mark.ssh
def test_hosts_add_over_ssh_shows_fingerprint(tmp_path: Path, sshd: SSHD) -> None:
    env = {
        "EAGLEWATCH_SSH_CONFIG": str(sshd.ssh_config),
        "EAGLEWATCH_KNOWN_HOSTS": str(sshd.known_hosts),
        "EAGLEWATCH_REMOTE_BASE": str(tmp_path / "remote"),
    }
    res = cli(
        tmp_path,
        "hosts",
        "add",
        "gpu1",
        "--ssh",
        sshd.alias,
        "--python",
        "/usr/bin/python3",
        "--state-dir",
        str(tmp_path / "agent"),
        extra_env=env,
    )
    assert res.returncode == 0, res.stderr
    fp = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(sshd.host_key.with_suffix(".pub"))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[1]
    assert fp in res.stdout and "connected: agent" in res.stdout
    sshd.known_hosts.write_text("")
    res = cli(tmp_path, "hosts", "add", "gpu2", "--ssh", sshd.alias, extra_env=env)
    assert res.returncode == 0 and fp in res.stdout
    assert "not trusted" in res.stderr and "known_hosts" in res.stderr
    check = cli(tmp_path, "hosts", "check", "gpu2", extra_env=env)
    assert check.returncode == 1 and "not trusted" in check.stderr


def test_a_completed_run_whose_files_all_failed_is_no_success(tmp_path: Path) -> None:
    """The demo's broken run: the verdict, in the warning colour, in ls and show; problems grouped."""
    from tests.helpers.broken_run import seed

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    seed(home / "eaglewatch.db", "/scratch/out")
    shown = json.loads(cli(tmp_path, "runs", "show", "r-broken", "--json").stdout)
    assert (shown["state"], shown["verdict"]) == ("completed", "problems")
    assert (
        shown["verdict_text"]
        == "completed — 24 of 24 files failed shape checks; no file is good; 1 alert raised"
    )
    (listed,) = json.loads(cli(tmp_path, "runs", "ls", "--json").stdout)
    assert listed["verdict"] == "problems"
    color = {"FORCE_COLOR": "1", "TERM": "xterm-256color"}
    text = cli(tmp_path, "runs", "show", "r-broken", extra_env=color).stdout
    yellow = "\x1b[1;33m"
    assert f"{yellow}completed — 24 of 24 files failed shape checks; no file is good" in text
    problems = [ln for ln in text.splitlines() if "problem layer_count_mismatch" in ln]
    assert len(problems) == 1 and "in 24 files (hs_0 … hs_23)" in problems[0]
    assert "/scratch/out/hs_" not in text
    plain = cli(tmp_path, "runs", "show", "r-broken").stdout.splitlines()
    assert plain[0].startswith("r-broken  completed — 24 of 24 files failed shape checks") and len(plain) < 20
    assert "  exit: exit code 0" in plain and not any("EAGLEWATCH {" in ln or "{'" in ln for ln in plain)
    said = [ln for ln in plain if ln.startswith(("  problem ", "  alert ", "  last milestones"))]
    assert [ln.split()[0] for ln in said] == ["problem", "alert", "last"], plain
    raw = cli(tmp_path, "runs", "show", "r-broken", "--raw").stdout.splitlines()
    assert raw[: len(plain)] == plain and len(raw) == len(plain) + len(shown["milestones"])
    table = cli(tmp_path, "runs", "ls", extra_env=color).stdout
    assert f"{yellow}completed — 24 of 24 files" in table


def test_hosts_add_a_slurm_host_and_refuse_bad_slurm_options(tmp_path: Path, reap: None) -> None:
    bad = cli(
        tmp_path, "hosts", "add", "hpc", "--ssh", "login1", "--scheduler", "slurm", "--sbatch-arg", "-p x"
    )
    assert bad.returncode != 0 and "not one long option" in bad.stderr
    lone = cli(tmp_path, "hosts", "add", "hpc", "--ssh", "login1", "--partition", "gpu")
    assert lone.returncode != 0 and "need scheduler 'slurm'" in lone.stderr
    ok = cli(
        tmp_path, "hosts", "add", "hpc", "--ssh", "local", "--state-dir", str(tmp_path / "agent"),
        "--scheduler", "slurm", "--partition", "gpu", "--account", "lab",
        "--sbatch-arg", "--qos=high", "--sbatch-arg", "--constraint=h200", "--slurm-gpus", "none",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    hosts = json.loads(cli(tmp_path, "hosts", "ls", "--json").stdout)
    assert [
        (h["scheduler"], h["partition"], h["account"], h["sbatch_args"], h["slurm_gpus"]) for h in hosts
    ] == [("slurm", "gpu", "lab", ["--qos=high", "--constraint=h200"], "none")]
    assert "slurm gpu" in cli(tmp_path, "hosts", "ls").stdout
    bad_limit = cli(tmp_path, "runs", "start", "--host", "hpc", "--time-limit-minutes", "0", "--", "true")
    assert bad_limit.returncode != 0 and "time_limit_minutes" in bad_limit.stderr
