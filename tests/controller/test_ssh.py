"""Hosts over a real OpenSSH sshd: alias from ssh_config, host-key verification, bootstrap, link loss."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import agent
from agent.spec import parse_spec
from controller.bootstrap import fetch_host_key
from controller.errors import HostKeyRejected
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.helpers.sshd import SSHD, keygen

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]
HOST = HostCreate(name="gpu1", ssh="eaglehost", python="/usr/bin/python3")


def _fingerprint(pub: Path) -> str:
    out = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(pub)], capture_output=True, text=True, check=True
    ).stdout
    return out.split()[1]


def _host(tmp_path: Path) -> HostCreate:
    return HOST.model_copy(update={"state_dir": str(tmp_path / "agent")})


async def test_add_check_bootstraps_agent_with_system_python(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings
) -> None:
    """The alias resolves through ssh_config; the stdlib agent is uploaded and run by /usr/bin/python3."""
    async with Controller(ssh_settings, supervise=False) as ctl:
        await ctl.add_host(_host(tmp_path))
        expected = _fingerprint(sshd.host_key.with_suffix(".pub"))
        assert await fetch_host_key(HOST.ssh, ssh_settings) == expected
        host = await ctl.check_host("gpu1")
        assert host.reachable is True and host.agent_version == agent.__version__
        assert host.fingerprint == expected and host.gpus == []
    uploaded = list((tmp_path / "remote").glob("agent-*/agent/protocol.py"))
    assert len(uploaded) == 1
    assert (tmp_path / "agent" / "agent.sock").exists()


async def test_unknown_host_key_is_not_accepted(tmp_path: Path, sshd: SSHD, ssh_settings: Settings) -> None:
    sshd.known_hosts.write_text("")
    async with Controller(ssh_settings, supervise=False) as ctl:
        await ctl.add_host(_host(tmp_path))
        with pytest.raises(HostKeyRejected, match="not trusted") as info:
            await ctl.check_host("gpu1")
        assert info.value.fingerprint == _fingerprint(sshd.host_key.with_suffix(".pub"))
        assert (await ctl.get_host("gpu1")).reachable is False
    assert sshd.known_hosts.read_text() == ""  # never auto-accepted
    assert not (tmp_path / "remote").exists()  # nothing uploaded to an untrusted host


async def test_changed_host_key_refused_and_alerted(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings
) -> None:
    async with Controller(ssh_settings) as ctl:
        await ctl.add_host(_host(tmp_path))
        await wait_for(lambda: _reachable(ctl, True), what="first connection")
        other = keygen(tmp_path / "other_key")
        sshd.known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {' '.join(other.split()[:2])}\n")
        sshd.kill_sessions()
        await wait_for(lambda: _reachable(ctl, False), what="host marked unreachable")

        async def alerted() -> bool:
            return any(a.rule == "host_key_changed" and a.host == "gpu1" for a in await ctl.list_alerts())

        await wait_for(alerted, what="host_key_changed alert")
        alert = next(a for a in await ctl.list_alerts() if a.rule == "host_key_changed")
        assert "gpu1" in alert.message and alert.severity == "critical"
        host = await ctl.get_host("gpu1")
        assert host.last_error and "not trusted" in host.last_error


async def _reachable(ctl: Controller, value: bool) -> bool:
    return (await ctl.get_host("gpu1")).reachable is value


async def test_dropped_link_makes_runs_unknown_never_failed(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings, job_script: Path
) -> None:
    stop = tmp_path / "stop"
    async with Controller(ssh_settings) as ctl:
        await ctl.add_host(_host(tmp_path))
        await wait_for(lambda: _reachable(ctl, True), what="connection")
        run_id = await ctl.create_run(
            parse_spec(
                {
                    "host": "gpu1",
                    "backend": "command",
                    "command": ["/usr/bin/python3", str(job_script), str(stop), "0.05"],
                }
            )
        )
        await wait_for(lambda: _milestones(ctl, run_id, 3), what="milestones")
        sshd.stop()
        sshd.kill_sessions()
        await wait_for(lambda: _state(ctl, run_id, "unknown"), what="run unknown")
        assert (await ctl.get_host("gpu1")).reachable is False
        sshd.restart()
        await wait_for(lambda: _state(ctl, run_id, "running"), what="run running again")
        stop.write_text("")
        await wait_for(lambda: _state(ctl, run_id, "completed"), what="run completed")
        detail = await ctl.get_run(run_id)
        seqs = [m.seq for m in detail.milestones]
        assert seqs == sorted(set(seqs))
        assert not any(a.rule == "run_failed" for a in detail.alerts)


async def _milestones(ctl: Controller, run_id: str, n: int) -> bool:
    return len((await ctl.get_run(run_id)).milestones) >= n


async def _state(ctl: Controller, run_id: str, state: str) -> bool:
    return (await ctl.get_run(run_id)).state == state


def test_sshd_fixture_serves_openssh_client(sshd: SSHD) -> None:
    out = subprocess.run(sshd.ssh_argv("echo", "ok"), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert sys.executable
