"""Slurm hosts on the web: the Add-host page and API (CSRF, errors by field), a queued run's page."""

from __future__ import annotations

import httpx

from controller.service import Controller
from tests.web.conftest import csrf_of

PAYLOAD = "<script>alert(1)</script>"


async def test_add_a_slurm_host_from_the_form(client: httpx.AsyncClient, ctl: Controller) -> None:
    page = await client.get("/hosts/new")
    assert page.status_code == 200 and 'name="sbatch_args"' in page.text
    form = {"name": "hpc", "ssh": "login1", "python": "python3", "scheduler": "slurm", "partition": "gpu",
            "account": "lab", "sbatch_args": "--qos=high\n\n--constraint=h200\n",
            "slurm_gpus": "gres"}  # fmt: skip
    assert (await client.post("/hosts/new", data=form)).status_code == 403  # no CSRF token
    r = await client.post("/hosts/new", data={**form, "csrf_token": await csrf_of(client)})
    assert r.status_code == 303 and r.headers["location"] == "/hosts"
    host = await ctl.get_host("hpc")
    assert (host.scheduler, host.partition, host.account, host.slurm_gpus) == ("slurm", "gpu", "lab", "gres")
    assert host.sbatch_args == ["--qos=high", "--constraint=h200"]
    dash = (await client.get("/")).text
    assert "Slurm · partition gpu · account lab" in dash


async def test_bad_slurm_settings_show_next_to_their_field(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    tok = await csrf_of(client)
    form = {"csrf_token": tok, "name": "hpc", "ssh": "login1", "scheduler": "slurm",
            "partition": "gpu" + PAYLOAD, "sbatch_args": "--output=/tmp/x"}  # fmt: skip
    r = await client.post("/hosts/new", data=form)
    assert r.status_code == 422
    assert 'id="err-partition"' in r.text and "Slurm name" in r.text
    assert 'id="err-sbatch_args"' in r.text and "--output is set by eaglewatch itself" in r.text
    assert PAYLOAD not in r.text and "&lt;script&gt;" in r.text
    plain = {"csrf_token": tok, "name": "h2", "ssh": "login1", "scheduler": "none", "partition": "gpu"}
    r = await client.post("/hosts/new", data=plain)
    assert r.status_code == 422 and "need scheduler" in r.text
    assert await ctl.list_hosts() == []


async def test_api_adds_a_slurm_host_and_names_a_bad_field(client: httpx.AsyncClient) -> None:
    tok = await csrf_of(client)
    body = {
        "name": "hpc",
        "ssh": "login1",
        "scheduler": "slurm",
        "partition": "gpu",
        "sbatch_args": ["--qos=x"],
    }
    r = await client.post("/api/hosts", json=body, headers={"x-csrf-token": tok})
    assert r.status_code == 201, r.text
    got = (await client.get("/api/hosts/hpc")).json()
    assert (got["scheduler"], got["partition"], got["sbatch_args"], got["slurm_gpus"]) == (
        "slurm",
        "gpu",
        ["--qos=x"],
        "gpus-per-task",
    )
    bad = {"name": "h2", "ssh": "login1", "scheduler": "pbs"}
    r = await client.post("/api/hosts", json=bad, headers={"x-csrf-token": tok})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "scheduler"
    schema = (await client.get("/openapi.json")).json()
    assert "sbatch_args" in schema["components"]["schemas"]["HostCreate"]["properties"]


def test_the_run_form_carries_a_time_limit() -> None:
    from web import forms

    base = {"name": "r", "host": "hpc", "backend": "command", "command": "true"}
    spec, errors = forms.check_form({**base, "time_limit_minutes": "30"})
    assert errors == {} and spec is not None and spec.time_limit_minutes == 30
    assert forms.spec_to_form(spec.model_dump(mode="json"))["time_limit_minutes"] == "30"
    _, errors = forms.check_form({**base, "time_limit_minutes": "0"})
    assert "greater than or equal to 1" in errors["time_limit_minutes"]


async def test_a_queued_slurm_run_page_shows_its_job_and_why_it_waits(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    """The run row and journal events as the agent on a Slurm host reports them (stored through crud)."""
    import json

    from controller import crud
    from controller.lifecycle import RunEvent
    from controller.store import Tx

    tok = await csrf_of(client)
    body = {"name": "hpc", "ssh": "login1", "scheduler": "slurm"}
    assert (await client.post("/api/hosts", json=body, headers={"x-csrf-token": tok})).status_code == 201
    spec = {"host": "hpc", "backend": "command", "command": ["true"]}
    queued = {"seq": 2, "ts": 1.0, "type": "milestone", "kind": "queued", "line": 0, "rank": None,
              "fields": {"job_id": "42", "reason": "Priority", "position": 3},
              "text": "Slurm job 42 PENDING: waiting in the queue (reason Priority, position 3)"}  # fmt: skip

    def seed(tx: Tx) -> None:
        crud.insert_run(tx=tx, run_id="r-q", name="q", host="hpc", backend="command", model=None,
                        spec_json=json.dumps(spec))  # fmt: skip
        crud.transition(tx=tx, run_id="r-q", event=RunEvent.LAUNCH, policy=ctl.policy)
        crud.set_pid(tx=tx, run_id="r-q", pid=None, scheduler_job="42")
        crud.transition(tx=tx, run_id="r-q", event=RunEvent.JOB_PENDING, policy=ctl.policy)
        crud.apply_events(tx=tx, run_id="r-q", events=[queued], policy=ctl.policy)

    await ctl.store.write(seed)
    run = await ctl.get_run("r-q")
    assert run.state == "pending" and run.scheduler_job == "42"
    html = (await client.get("/runs/r-q")).text
    assert 'id="slurm-job"' in html and "42 · Slurm job 42 PENDING" in html and "position 3" in html
    assert "Slurm job 42 is cancelled (scancel)" in html


def test_a_login_nodes_own_gpus_do_not_limit_tensor_parallel() -> None:
    import json

    import pytest

    from agent.spec import parse_spec
    from controller.errors import SpecInvalid
    from controller.runs import check_hosts, scheduler_args

    spec = parse_spec({"host": "hpc", "backend": "command", "command": ["true"], "tensor_parallel_size": 8})
    login = {"name": "hpc", "gpus_json": json.dumps([{"index": 0}]), "scheduler": "slurm",
             "partition": "gpu", "account": None, "sbatch_args_json": '["--qos=x"]',
             "slurm_gpus": "gres"}  # fmt: skip
    check_hosts(spec, {"hpc": login})
    with pytest.raises(SpecInvalid, match="8 > 1 GPUs"):
        check_hosts(spec, {"hpc": {**login, "scheduler": None}})
    assert scheduler_args(login) == {"kind": "slurm", "partition": "gpu", "account": None,
                                     "sbatch_args": ["--qos=x"], "gpus": "gres"}  # fmt: skip
    assert scheduler_args({**login, "scheduler": None}) is None
