"""The New-run form for backends speculators and specforge: options reach the spec, errors their field."""

from __future__ import annotations

import httpx

from controller.service import Controller
from tests.web.conftest import csrf_of
from web import forms

BASE = {"name": "r1", "host": "h1", "model": "/m", "dataset": "/d", "output_dir": "/out"}


def test_speculators_options_round_trip() -> None:
    form = {**BASE, "backend": "speculators", "pipeline_scripts_dir": "/opt/speculators/scripts",
            "pipeline_args": "--validate-outputs\n--world-size\n2\n--rank\n1", "server_port": "8123",
            "nproc_per_node": "4"}  # fmt: skip
    spec, errors = forms.check_form(form)
    assert errors == {} and spec is not None and spec.speculators is not None
    assert spec.speculators.scripts_dir == "/opt/speculators/scripts"
    assert spec.speculators.client_args == ["--validate-outputs", "--world-size", "2", "--rank", "1"]
    assert spec.speculators.port == 8123 and spec.specforge is None  # nproc_per_node is SpecForge's
    back = forms.spec_to_form(spec.model_dump(mode="json"))
    assert back["server_port"] == "8123" and back["pipeline_args"].splitlines()[0] == "--validate-outputs"
    assert forms.check_form({**back, "backend": "speculators"})[0] == spec


def test_specforge_needs_its_scripts_dir_and_errors_land_on_the_field() -> None:
    spec, errors = forms.check_form({**BASE, "backend": "specforge"})
    assert spec is None and "Field required" in errors.get("pipeline_scripts_dir", "")
    _, errors = forms.check_form({**BASE, "backend": "specforge", "pipeline_scripts_dir": "rel/scripts"})
    assert "absolute path" in errors["pipeline_scripts_dir"]
    _, errors = forms.check_form(
        {
            **BASE,
            "backend": "specforge",
            "pipeline_scripts_dir": "/sf/scripts",
            "pipeline_args": "--tp-size 2",
        }
    )
    assert "holds several words" in errors["pipeline_args"]
    _, errors = forms.check_form({**BASE, "backend": "specforge", "nproc_per_node": "two"})
    assert "whole number" in errors["nproc_per_node"]
    spec, errors = forms.check_form(
        {**BASE, "backend": "specforge", "pipeline_scripts_dir": "/sf/scripts", "nproc_per_node": "8"}
    )
    assert errors == {} and spec is not None and spec.specforge is not None
    assert (spec.specforge.scripts_dir, spec.specforge.nproc_per_node) == ("/sf/scripts", 8)


def test_pipeline_fields_are_ignored_for_other_backends() -> None:
    spec, errors = forms.check_form({**BASE, "backend": "vllm-native", "pipeline_scripts_dir": "/x"})
    assert errors == {} and spec is not None and spec.speculators is None and spec.specforge is None


async def test_new_run_page_offers_the_backends_and_shows_their_errors(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    tok = await csrf_of(client)
    assert (
        await client.post("/api/hosts", json={"name": "h1", "ssh": "h1"}, headers={"x-csrf-token": tok})
    ).is_success
    page = (await client.get("/runs/new")).text
    assert '<option value="speculators"' in page and '<option value="specforge"' in page
    for field in (
        "pipeline_scripts_dir",
        "pipeline_python",
        "pipeline_args",
        "server_port",
        "nproc_per_node",
    ):
        assert f'name="{field}"' in page
    payload = "<b>x</b>"
    form = {**BASE, "csrf_token": tok, "action": "launch", "backend": "specforge",
            "pipeline_scripts_dir": "rel/" + payload}  # fmt: skip
    r = await client.post("/runs/new", data=form)
    assert r.status_code == 422
    assert 'id="err-pipeline_scripts_dir"' in r.text and "absolute path" in r.text
    assert payload not in r.text and "&lt;b&gt;x&lt;/b&gt;" in r.text
    assert await ctl.list_runs() == []


async def test_the_api_names_the_nearest_field_of_a_misspelled_one(client: httpx.AsyncClient) -> None:
    tok = await csrf_of(client)
    spec = {**BASE, "modle": "/m", "specforge": {"scripts_dri": "/s"}}
    r = await client.post("/api/runs", json=spec, headers={"x-csrf-token": tok})
    assert r.status_code == 422
    assert {e["field"]: e["message"] for e in r.json()["errors"]} == {
        "modle": "not a spec field: did you mean model?",
        "specforge.scripts_dri": "not a spec field: did you mean scripts_dir?",
        "specforge.scripts_dir": "Field required",
    }
