"""Races on one output directory: parallel creates and parallel resumes through the API start one run, a
run is resumed once, and parallel launches straight to one agent daemon (two controllers) start one job."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest

from controller.service import Controller
from tests.adversarial.test_outdir_ownership import LAYERS_A, ended, extraction, model_dir, with_host
from tests.helpers.agentjobs import sleeper
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon
from tests.web.conftest import AgentHost, agent_host, client, ctl  # noqa: F401 (the fixtures)

__all__ = ["agent_daemon"]
pytestmark = pytest.mark.slow


async def test_parallel_creates_with_one_output_dir_start_one_run(
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
    agent_host: AgentHost,  # noqa: F811
    tmp_path: Path,
) -> None:
    c = await with_host(client, agent_host)
    out = tmp_path / "out"
    spec = {"name": "cmd", "host": "local", "backend": "command", "command": sleeper(tmp_path, seconds=120),
            "output_dir": str(out)}  # fmt: skip
    replies = await asyncio.gather(*(c.post("/api/runs", json=spec) for _ in range(3)))
    assert sorted(r.status_code for r in replies)[0] == 201, [r.text for r in replies]
    assert [r.status_code for r in replies].count(201) == 1, [r.text for r in replies]
    for r in replies:
        assert r.status_code == 201 or (r.status_code in (409, 422) and "output_dir" in r.text), r.text
    assert len((await c.get("/api/runs")).json()) == 1
    assert len(list((agent_host.state_dir / "runs").iterdir())) == 1


async def test_parallel_resumes_start_one_run_and_a_run_is_resumed_once(
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
    agent_host: AgentHost,  # noqa: F811
    tmp_path: Path,
) -> None:
    c = await with_host(client, agent_host)
    r = await c.post("/api/runs", json=extraction(model_dir(tmp_path), tmp_path / "out", LAYERS_A))
    assert r.status_code == 201, r.text
    first = r.json()["id"]
    assert await ended(ctl, first) == "failed"
    replies = await asyncio.gather(*(c.post(f"/api/runs/{first}/resume") for _ in range(4)))
    assert sorted(r.status_code for r in replies) == [201, 409, 409, 409], [r.text for r in replies]
    [second] = [r.json()["id"] for r in replies if r.status_code == 201]
    assert (await c.get(f"/api/runs/{first}")).json()["resumed_by"] == [second]
    assert len(list((agent_host.state_dir / "runs").iterdir())) == 2
    assert await ended(ctl, second) == "failed"
    again = await c.post(f"/api/runs/{first}/resume")  # ended, but resumed already: resume the newer one
    assert again.status_code == 409 and f"already resumed as {second}: resume {second}" in again.text
    third = await c.post(f"/api/runs/{second}/resume")
    assert third.status_code == 201, third.text


def test_parallel_launches_into_one_output_dir_start_one_job(agent_daemon: AgentProc, tmp_path: Path) -> None:
    argv = sleeper(tmp_path, seconds=120)
    out = str(tmp_path / "out")
    barrier = threading.Barrier(6)
    replies: list[dict[str, object]] = []

    def launch(i: int) -> None:
        with AgentClient(agent_daemon.socket) as c:
            barrier.wait()
            spec = {"backend": "command", "command": argv, "output_dir": out}
            replies.append(c.request("launch", run=f"r{i}", spec=spec))

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(replies) == 6
    started = [m for m in replies if m["type"] == "reply"]
    assert len(started) == 1, json.dumps(replies)
    for m in replies:
        assert m["type"] == "reply" or ("spec.output_dir" in str(m["message"]) and m["code"] == "bad_args"), m
    assert len(list((agent_daemon.state_dir / "runs").iterdir())) == 1
