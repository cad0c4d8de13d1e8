"""Attach from the New-run form (real uvicorn, real local agent): a missing pid is marked on its field and
nothing starts; a running job is attached, its page says so, and Stop only detaches (the job lives on)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.web.conftest import AgentHost, LiveServer, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def c(agent_host: AgentHost, live_server: LiveServer) -> Iterator[httpx.Client]:
    """A client of the live server (session + CSRF header) with the local agent added as host 'local'."""
    with httpx.Client(base_url=live_server.url, timeout=120) as client:
        client.headers["x-csrf-token"] = client.get("/api/csrf").json()["csrf_token"]
        r = client.post(
            "/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)}
        )
        assert r.status_code == 201, r.text
        yield client


@pytest.fixture
def job(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A job started by hand: it prints a line and sleeps (its own session, stdout to job.log)."""
    with open(tmp_path / "job.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    yield proc
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_attach_from_the_form_then_stop_only_detaches(
    c: httpx.Client, tmp_path: Path, job: subprocess.Popen[bytes]
) -> None:
    base = {"csrf_token": c.headers["x-csrf-token"], "action": "launch", "name": "byhand", "host": "local",
            "backend": "worker-extension", "attach_log": str(tmp_path / "job.log")}  # fmt: skip
    r = c.post("/runs/new", data={**base, "attach_pid": "4000000"})
    assert r.status_code == 422
    marked = re.search(r'<p class="field-error" id="err-attach_pid" role="alert">([^<]*)</p>', r.text)
    assert marked is not None and "no process 4000000 runs on this host" in marked.group(1)
    assert c.get("/api/runs").json() == []

    r = c.post("/runs/new", data={**base, "attach_pid": str(job.pid)}, follow_redirects=False)
    assert r.status_code == 303, r.text[-2000:]
    page_url = r.headers["location"]
    run = page_url.rsplit("/", 1)[1]
    wait_until(lambda: c.get(f"/api/runs/{run}").json()["state"] == "running", 30, what="attached")
    html = c.get(page_url).text
    assert f"pid {job.pid} and its descendants" in html and "Stop only detaches" in html
    assert "Stop watching" in html and "is not signalled: it keeps running" in html

    r = c.post(f"/runs/{run}/stop", data={"csrf_token": c.headers["x-csrf-token"]}, follow_redirects=False)
    assert r.status_code == 303
    shown = wait_until(
        lambda: (d := c.get(f"/api/runs/{run}").json())["state"] == "stopped" and d, 30, what="stopped"
    )
    assert shown["exit"] == {"code": None, "signal": None}
    assert job.poll() is None  # never signalled
    html = c.get(page_url).text
    assert "exit status unknown: the job was not started by eaglewatch" in html
