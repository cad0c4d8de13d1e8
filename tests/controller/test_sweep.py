"""Alerts on absence, through a running controller: a stalled run and a host unreachable too long."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.spec import parse_spec
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.helpers.sshd import free_port

pytestmark = pytest.mark.timeout(120)


async def test_stall_alert_when_progress_stops(tmp_path: Path, reap: None, job_script: Path) -> None:
    settings = Settings(home=tmp_path / "home", stall_factor=3, stall_min_s=1.0, sweep_interval_s=0.2)
    async with Controller(settings) as ctl:
        await ctl.add_host(HostCreate(name="loc", ssh="local", state_dir=str(tmp_path / "agent")))
        # 10 progress lines 50 ms apart, then silence (the job waits for a stop file that never comes)
        script = tmp_path / "stall.py"
        script.write_text(
            "import json, time\n"
            "for i in range(10):\n"
            "    print('EAGLEWATCH ' + json.dumps({'kind': 'progress', 'samples_done': i}), flush=True)\n"
            "    time.sleep(0.05)\n"
            "time.sleep(60)\n"
        )
        run_id = await ctl.create_run(
            parse_spec(
                {
                    "host": "loc",
                    "backend": "command",
                    "command": [sys.executable, str(script), str(tmp_path / "marker")],
                }
            )
        )

        async def stalled() -> bool:
            return any(a.rule == "stall" for a in (await ctl.get_run(run_id)).alerts)

        await wait_for(stalled, timeout=30, what="stall alert")
        assert (await ctl.get_run(run_id)).state == "running"
        await ctl.stop_run(run_id)


async def test_host_unreachable_alert(tmp_path: Path) -> None:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host dead\n  HostName 127.0.0.1\n  Port {free_port()}\n")
    (tmp_path / "kh").write_text("")
    settings = Settings(
        home=tmp_path / "home",
        ssh_config=cfg,
        known_hosts=tmp_path / "kh",
        unreachable_minutes=0.01,
        sweep_interval_s=0.2,
        reconnect_max_s=0.5,
    )
    async with Controller(settings) as ctl:
        await ctl.add_host(HostCreate(name="dead", ssh="dead"))

        async def alerted() -> bool:
            return [a.rule for a in await ctl.list_alerts()] == ["host_unreachable"]

        await wait_for(alerted, timeout=30, what="host_unreachable alert")
        host = await ctl.get_host("dead")
        assert host.reachable is False and host.last_error and "cannot connect" in host.last_error
