"""Bootstrap against a real sshd started without the ``Subsystem sftp`` line: the agent still arrives."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import agent
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.helpers.sshd import SSHD

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]


@pytest.fixture
def bare_sshd(tmp_path: Path, reap: None) -> Iterator[SSHD]:
    """A real OpenSSH server offering no sftp subsystem."""
    server = SSHD.start(tmp_path / "sshd", sftp=False)
    yield server
    server.stop()


def _settings(tmp_path: Path, sshd: SSHD) -> Settings:
    return Settings(
        home=tmp_path / "home",
        known_hosts=sshd.known_hosts,
        ssh_config=sshd.ssh_config,
        remote_base=str(tmp_path / "remote"),
        connect_timeout=5,
    )


async def test_agent_uploaded_over_exec_channel_without_sftp(tmp_path: Path, bare_sshd: SSHD) -> None:
    """No sftp subsystem: the agent is uploaded through a fixed receiver program and the link comes up."""
    host = HostCreate(name="gpu1", ssh="eaglehost", python="/usr/bin/python3", state_dir=str(tmp_path / "ag"))
    async with Controller(_settings(tmp_path, bare_sshd), supervise=False) as ctl:
        await ctl.add_host(host)
        checked = await ctl.check_host("gpu1")
        assert checked.reachable is True and checked.agent_version == agent.__version__
        # a second connect finds the complete copy and uploads nothing new
        await ctl.check_host("gpu1")
    copies = list((tmp_path / "remote").iterdir())
    assert [c.name for c in copies] == [c.name for c in copies if ".tmp-" not in c.name] and len(copies) == 1
    uploaded = copies[0] / "agent"
    for rel in ("protocol.py", "milestones/rules/vllm.toml", "daemon/bridge.py"):
        assert (uploaded / rel).read_bytes() == (Path(agent.__file__).parent / rel).read_bytes()
    assert (copies[0] / ".complete").exists()
