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


#: Progress lines 50 ms apart, then FILES capture files over about 10 s with no progress line (a plain line
#: every 100 files), then exit: the files and their checks are all that advances.
WRITER = """
import json, os, struct, sys, time
out, n = sys.argv[1], int(sys.argv[2])
for i in range(10):
    print('EAGLEWATCH ' + json.dumps({'kind': 'progress', 'samples_done': i}), flush=True)
    time.sleep(0.05)
ids = struct.pack("<3q", 1, 2, 3)
hs = struct.pack("<H", 0x3F80) * (3 * 4 * 16)
header = {
    "token_ids": {"dtype": "I64", "shape": [3], "data_offsets": [0, 24]},
    "hidden_states": {"dtype": "BF16", "shape": [3, 4, 16], "data_offsets": [24, 24 + len(hs)]},
}
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
blob = struct.pack("<Q", len(raw)) + raw + ids + hs
start = time.monotonic()
for i in range(n):
    with open(os.path.join(out, f".hs_{i}.tmp"), "wb") as f:
        f.write(blob)
    os.rename(os.path.join(out, f".hs_{i}.tmp"), os.path.join(out, f"hs_{i}.safetensors"))
    if i % 100 == 99:
        print("wrote", i + 1, flush=True)
    time.sleep(max(0.0, start + 10.0 * (i + 1) / n - time.monotonic()))
"""


async def test_no_stall_while_files_are_written_and_checked(tmp_path: Path, reap: None) -> None:
    settings = Settings(home=tmp_path / "home", stall_factor=3, stall_min_s=6.0, sweep_interval_s=0.2)
    files = 1500
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    out = tmp_path / "cap"
    out.mkdir()
    async with Controller(settings) as ctl:
        await ctl.add_host(HostCreate(name="loc", ssh="local", state_dir=str(tmp_path / "agent")))
        spec = {
            "host": "loc",
            "backend": "command",
            "command": [sys.executable, str(script), str(out), str(files)],
            "output_dir": str(out),
            "expect": {"layers": 4, "hidden_size": 16},
        }
        run_id = await ctl.create_run(parse_spec(spec))

        async def ended() -> bool:
            return (await ctl.get_run(run_id)).state == "completed"

        await wait_for(ended, timeout=60, what="the run's end")
        run = await ctl.get_run(run_id)
        assert [a.message for a in run.alerts] == []
        assert sum(m.kind == "shape_check_passed" for m in run.milestones) == files


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
