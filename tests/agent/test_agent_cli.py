"""The ``eaglewatch-agent`` command line as a real subprocess: version, bad arguments, connect, launch."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import __version__
from tests.helpers.agentjobs import printer
from tests.helpers.agentproc import REPO, cleanup_runs


def _agent(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    st = tmp_path / "st"
    yield st
    lock = st / "daemon.lock"
    if lock.exists() and lock.read_text().strip():
        pid = int(lock.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the daemon that `connect` started (its own session)
    cleanup_runs(st)


def test_version() -> None:
    out = _agent("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"eaglewatch-agent {__version__}"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((), "COMMAND"),
        (("frobnicate",), "invalid choice"),
        (("launch",), "--spec"),
        (("daemon", "--bogus"), "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: tuple[str, ...], words: str) -> None:
    out = _agent(*args)
    assert out.returncode == 2
    assert words in out.stderr


def test_connect_starts_a_daemon_and_bridges(state: Path) -> None:
    requests = "".join(json.dumps({"id": i, "op": op}) + "\n" for i, op in enumerate(["version", "list"]))
    out = _agent("connect", "--state-dir", str(state), stdin=requests)
    assert out.returncode == 0, out.stderr
    msgs = [json.loads(line) for line in out.stdout.splitlines()]
    assert msgs[0]["type"] == "hello"
    assert msgs[1]["id"] == 0 and msgs[1]["result"]["agent_version"] == __version__
    assert msgs[2]["id"] == 1 and msgs[2]["result"] == {"runs": []}
    # The daemon outlives the connect process; a second connect reuses it.
    pid = int((state / "daemon.lock").read_text())
    again = _agent("connect", "--state-dir", str(state), stdin=json.dumps({"id": 9, "op": "version"}) + "\n")
    assert json.loads(again.stdout.splitlines()[0])["pid"] == pid


def test_launch_command_prints_the_reply(state: Path, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "name": "cli",
                "host": "h",
                "backend": "command",
                "command": printer(tmp_path, ["hello from the job"]),
            }
        )
    )
    out = _agent("launch", "--spec", str(spec), "--state-dir", str(state))
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["ok"] is True and reply["result"]["run"].startswith("cli-")
    run = reply["result"]["run"]
    log = state / "runs" / run / "output.log"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "hello from the job" not in (
        log.read_text() if log.exists() else ""
    ):
        time.sleep(0.05)
    assert "hello from the job" in log.read_text()
    dup = _agent("launch", "--spec", str(spec), "--state-dir", str(state), "--run", run)
    assert dup.returncode == 1 and json.loads(dup.stdout)["code"] == "conflict"
    bad = _agent("launch", "--spec", str(tmp_path / "missing.json"), "--state-dir", str(state))
    assert bad.returncode == 2 and "cannot read spec" in bad.stderr


def test_delegated_commands_are_dispatched(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("INFO 02-21 22:48:02 [default_loader.py:384] Loading weights took 2.35 seconds\n")
    out = _agent("milestones", str(log), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["kind"] == "weights_loaded"
    missing = _agent("check", str(tmp_path / "nothing-here"))
    assert missing.returncode == 2
