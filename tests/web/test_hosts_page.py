"""The Hosts page in-process: what each host shows, and removal refused while a run has not ended."""

from __future__ import annotations

import json

import httpx

from controller import crud
from controller.lifecycle import RunEvent
from controller.models import HostCreate
from controller.service import Controller
from controller.store import Tx
from tests.web.conftest import csrf_of


async def _host_with_active_run(ctl: Controller) -> None:
    await ctl.add_host(HostCreate(name="gpu1", ssh="gpu1.example"))

    def seed(tx: Tx) -> None:
        spec = json.dumps({"host": "gpu1", "backend": "command", "command": ["true"]})
        crud.insert_run(tx=tx, run_id="r-busy", name="busy", host="gpu1", backend="command", model=None,
                        spec_json=spec)  # fmt: skip
        crud.transition(tx=tx, run_id="r-busy", event=RunEvent.LAUNCH, policy=ctl.policy)

    await ctl.store.write(seed)


async def test_hosts_page_lists_each_host_with_scheduler_and_runs(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    await _host_with_active_run(ctl)
    await ctl.add_host(HostCreate(name="hpc", ssh="login1", scheduler="slurm", partition="gpu"))
    page = await client.get("/hosts")
    assert page.status_code == 200
    assert 'href="/hosts"' in page.text  # the nav link
    assert 'data-host="gpu1"' in page.text and 'data-host="hpc"' in page.text
    assert "ssh: runs start on the host" in page.text and "Slurm · partition gpu" in page.text
    assert 'href="/runs/r-busy"' in page.text and "no runs" in page.text


async def test_removing_a_host_with_an_active_run_is_refused_with_the_reason(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    await _host_with_active_run(ctl)
    assert (await client.post("/hosts/gpu1/remove")).status_code == 403  # no CSRF token
    r = await client.post("/hosts/gpu1/remove", data={"csrf_token": await csrf_of(client)})
    assert r.status_code == 409
    assert 'id="hosts-error"' in r.text and "unfinished runs: r-busy" in r.text and "Stop them" in r.text
    assert [h.name for h in await ctl.list_hosts()] == ["gpu1"]
    api = await client.delete("/api/hosts/gpu1", headers={"x-csrf-token": await csrf_of(client)})
    assert api.status_code == 409 and api.json()["error"] == "conflict"

    await ctl.store.write(
        lambda tx: crud.transition(tx=tx, run_id="r-busy", event=RunEvent.LAUNCH_FAILED, policy=ctl.policy)
    )
    r = await client.post("/hosts/gpu1/remove", data={"csrf_token": await csrf_of(client)})
    assert r.status_code == 303 and r.headers["location"] == "/hosts"
    assert await ctl.list_hosts() == []
    missing = await client.post("/hosts/gpu1/remove", data={"csrf_token": await csrf_of(client)})
    assert missing.status_code == 404
