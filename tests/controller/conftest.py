"""Fixtures for controller tests: a real sshd, settings pointing at it, cleanup of every started process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.settings import Settings
from tests.helpers.sshd import SSHD, kill_tree_matching

JOB = """\
import json, os, sys, time
stop_file, interval = sys.argv[1], float(sys.argv[2])
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 10**9
i = 0
while i < limit and not os.path.exists(stop_file):
    print("EAGLEWATCH " + json.dumps({"kind": "progress", "samples_done": i}), flush=True)
    print(f"plain line {i}", flush=True)
    i += 1
    time.sleep(interval)
print("job done", flush=True)
"""


@pytest.fixture
def reap(tmp_path: Path) -> Iterator[None]:
    """Kill every process (daemon, bridge, job) whose cmdline or environment names this test's tmp dir."""
    yield
    kill_tree_matching(str(tmp_path) + "/")


@pytest.fixture
def job_script(tmp_path: Path) -> Path:
    """A job printing a progress milestone and a plain line every interval until a stop file appears."""
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


@pytest.fixture
def sshd(tmp_path: Path, reap: None) -> Iterator[SSHD]:
    """A real OpenSSH server on 127.0.0.1 (see tests/helpers/sshd.py)."""
    server = SSHD.start(tmp_path / "sshd")
    yield server
    server.stop()


@pytest.fixture
def ssh_settings(tmp_path: Path, sshd: SSHD) -> Settings:
    """Controller settings reaching ``sshd`` through its ssh_config alias, state under tmp_path."""
    return Settings(
        home=tmp_path / "home",
        known_hosts=sshd.known_hosts,
        ssh_config=sshd.ssh_config,
        remote_base=str(tmp_path / "remote"),
        reconnect_initial_s=0.1,
        reconnect_max_s=0.5,
        connect_timeout=5,
        keepalive_interval=2,
    )


@pytest.fixture
def local_settings(tmp_path: Path, reap: None) -> Settings:
    """Controller settings for tests using the local (no SSH) transport."""
    return Settings(home=tmp_path / "home", reconnect_initial_s=0.1, reconnect_max_s=0.5)


async def wait_for(cond: Callable[[], Awaitable[Any]], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll an async predicate until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
