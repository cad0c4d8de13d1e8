"""Durable catch-up through a real sshd: 20 link kills mid-run, and a SIGKILLed controller process.

Afterwards the database must hold every journal event exactly once and in order, and every log line of the
job's output.log exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path

import pytest

from agent.spec import parse_spec
from controller import queries
from controller.models import HostCreate
from controller.service import Controller
from controller.settings import Settings
from tests.controller.conftest import wait_for
from tests.helpers.controllerproc import spawn_controller
from tests.helpers.sshd import SSHD

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(240)]


def _assert_complete(db: Path, run_id: str, agent_state: Path) -> None:
    """Events 1..N exactly once in insertion order, and the stored log equals output.log."""
    conn = sqlite3.connect(db)
    try:
        seqs = [
            r[0]
            for r in conn.execute(
                "SELECT seq FROM events WHERE run_id=? AND seq IS NOT NULL ORDER BY id", (run_id,)
            )
        ]
        journal = [
            json.loads(line)
            for line in (agent_state / "runs" / run_id / "events.jsonl").read_text().splitlines()
            if line.strip()
        ]
        assert seqs == [e["seq"] for e in journal] == list(range(1, len(journal) + 1))
        ms = [r[0] for r in conn.execute("SELECT seq FROM milestones WHERE run_id=? ORDER BY id", (run_id,))]
        assert ms == [e["seq"] for e in journal if e["type"] == "milestone"]
        conn.row_factory = sqlite3.Row
        stored = [ln["text"] for ln in queries.read_log(conn, run_id, -1, 100000, None, False)]
        assert stored == (agent_state / "runs" / run_id / "output.log").read_text().splitlines()
        assert conn.execute("SELECT state FROM runs WHERE id=?", (run_id,)).fetchone()[0] == "completed"
    finally:
        conn.close()


async def test_link_killed_20_times_mid_run(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings, job_script: Path
) -> None:
    stop = tmp_path / "stop"
    host = HostCreate(
        name="gpu1", ssh="eaglehost", python="/usr/bin/python3", state_dir=str(tmp_path / "agent")
    )
    async with Controller(ssh_settings) as ctl:
        await ctl.add_host(host)
        sup = ctl.supervisors.hosts["gpu1"]
        await sup.connected.wait()
        run_id = await ctl.create_run(
            parse_spec(
                {
                    "host": "gpu1",
                    "backend": "command",
                    "command": ["/usr/bin/python3", str(job_script), str(stop), "0.02"],
                }
            )
        )
        kills = 0
        while kills < 20:
            seen = len((await ctl.get_run(run_id)).milestones)

            async def progressed(seen: int = seen) -> bool:
                return (
                    sup.connected.is_set()
                    and run_id in sup.following
                    and len((await ctl.get_run(run_id)).milestones) > seen
                )

            await wait_for(progressed, what=f"new milestones after kill {kills}")
            kills += sshd.kill_sessions() > 0
        stop.write_text("")

        async def done() -> bool:
            return (await ctl.get_run(run_id)).state == "completed"

        await wait_for(done, what="completion")
        # the last lines follow the final state event by a moment
        out_log = tmp_path / "agent" / "runs" / run_id / "output.log"

        async def all_lines() -> bool:
            return len(await ctl.read_log(run_id, limit=100000)) == len(out_log.read_text().splitlines())

        await wait_for(all_lines, what="every log line")
    assert kills == 20
    _assert_complete(ssh_settings.database, run_id, tmp_path / "agent")


def _milestone_count(db: Path, run_id: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT count(*) FROM milestones WHERE run_id=?", (run_id,)).fetchone()[0])
    finally:
        conn.close()


async def test_controller_sigkilled_and_restarted_mid_run(
    tmp_path: Path, sshd: SSHD, ssh_settings: Settings, job_script: Path
) -> None:
    stop = tmp_path / "stop"
    host = HostCreate(
        name="gpu1", ssh="eaglehost", python="/usr/bin/python3", state_dir=str(tmp_path / "agent")
    )
    async with Controller(ssh_settings, supervise=False) as ctl:  # the CLI's way: one-shot link
        await ctl.add_host(host)
        run_id = await ctl.create_run(
            parse_spec(
                {
                    "host": "gpu1",
                    "backend": "command",
                    "command": ["/usr/bin/python3", str(job_script), str(stop), "0.02"],
                }
            )
        )
        assert (await ctl.get_run(run_id)).state == "running"
    db = ssh_settings.database
    proc = spawn_controller(ssh_settings, EAGLEWATCH_RECONNECT_MAX_S="0.5")
    try:

        async def some() -> bool:
            return _milestone_count(db, run_id) >= 20

        await wait_for(some, what="first controller ingesting")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        before = _milestone_count(db, run_id)
        await wait_for(lambda: _sleep_true(1.0), what="job running on")
        proc = spawn_controller(ssh_settings, EAGLEWATCH_RECONNECT_MAX_S="0.5")

        async def more() -> bool:
            return _milestone_count(db, run_id) > before + 20

        await wait_for(more, what="restarted controller catching up")
        stop.write_text("")

        async def done() -> bool:
            conn = sqlite3.connect(db)
            try:
                row = conn.execute("SELECT state FROM runs WHERE id=?", (run_id,)).fetchone()
                conn.row_factory = sqlite3.Row
                n = len(queries.read_log(conn, run_id, -1, 100000, None, False))
            finally:
                conn.close()
            out_log = tmp_path / "agent" / "runs" / run_id / "output.log"
            return row[0] == "completed" and n == len(out_log.read_text().splitlines())

        await wait_for(done, what="completion recorded by the restarted controller")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _assert_complete(db, run_id, tmp_path / "agent")


async def _sleep_true(seconds: float) -> bool:
    import asyncio

    await asyncio.sleep(seconds)
    return True
