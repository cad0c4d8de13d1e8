"""Agent upgrade: a daemon of an older version is asked to shut down and replaced; its jobs keep running."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agent
from controller.bootstrap import AGENT_DIR, open_link
from controller.settings import Settings

pytestmark = pytest.mark.timeout(120)


def _old_daemon(tmp_path: Path, state: Path) -> subprocess.Popen[bytes]:
    old = tmp_path / "old"
    shutil.copytree(AGENT_DIR, old / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    init = old / "agent" / "__init__.py"
    init.write_text(init.read_text().replace(f'"{agent.__version__}"', '"0.0.9"'))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "daemon", "--state-dir", str(state)],
        cwd=old,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while not (state / "agent.sock").exists():
        assert time.monotonic() < deadline, "old daemon did not start"
        time.sleep(0.05)
    return proc


def _request(sock_path: Path, msg: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock_path))
        f = s.makefile("rwb")
        hello = json.loads(f.readline())
        f.write(json.dumps(msg).encode() + b"\n")
        f.flush()
        return hello, json.loads(f.readline())


async def test_older_daemon_is_replaced_and_job_survives(tmp_path: Path, reap: None) -> None:
    state = tmp_path / "agent"
    old = _old_daemon(tmp_path, state)
    try:
        spec = {
            "host": "loc",
            "backend": "command",
            "name": "long",
            "command": [sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "marker")],
        }
        hello, reply = _request(state / "agent.sock", {"id": 1, "op": "launch", "run": "r-old", "spec": spec})
        assert hello["agent_version"] == "0.0.9" and reply.get("ok"), reply
        job_pid = int(reply["result"]["pid"])  # type: ignore[index]

        host = {"name": "loc", "ssh": "local", "python": sys.executable, "state_dir": str(state)}
        link, _ = await open_link(host, Settings(home=tmp_path / "home"), None)
        try:
            assert link.hello["agent_version"] == agent.__version__
            assert old.wait(timeout=20) is not None  # the old daemon exited cleanly
            os.kill(job_pid, 0)  # the job is still alive
            status = await link.request("status", run="r-old")
            assert status["state"] == "running" and status["pid"] == job_pid
        finally:
            await link.close()
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()
