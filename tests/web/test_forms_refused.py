"""The New-run form refuses a spec whose host paths are unusable before anything starts: the agent checks
model, dataset, SpecForge scripts and output dir; the form marks the field (real app, real local agent)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.web.conftest import AgentHost, LiveServer

pytestmark = pytest.mark.slow


@pytest.fixture
def c(agent_host: AgentHost, live_server: LiveServer) -> Iterator[httpx.Client]:
    """A client of the live server (session + CSRF header) with the local agent added as host 'local'."""
    with httpx.Client(base_url=live_server.url, timeout=120) as client:
        client.headers["x-csrf-token"] = client.get("/api/csrf").json()["csrf_token"]
        r = client.post(
            "/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)}
        )
        assert r.status_code == 201, r.text
        yield client


def usable(tmp_path: Path) -> dict[str, str]:
    """Form fields of a SpecForge run whose every path exists on the host."""
    model, scripts = tmp_path / "model", tmp_path / "scripts"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 32}))
    scripts.mkdir()
    (scripts / "prepare_hidden_states.py").touch()
    (tmp_path / "data.jsonl").write_text('{"conversations": []}\n')
    return {"host": "local", "backend": "specforge", "model": str(model),
            "dataset": str(tmp_path / "data.jsonl"), "output_dir": str(tmp_path / "out"),
            "pipeline_scripts_dir": str(scripts)}  # fmt: skip


@pytest.mark.parametrize("action", ["launch", "forecast"])
def test_unusable_paths_are_marked_on_their_field_and_nothing_starts(
    c: httpx.Client, tmp_path: Path, action: str
) -> None:
    fields = usable(tmp_path)
    cases = [
        ("model", str(tmp_path / "no-model"), "does not exist on this host"),
        ("model", str(tmp_path / "scripts"), "has no config.json"),
        ("dataset", str(tmp_path / "none.jsonl"), "does not exist on this host"),
        ("pipeline_scripts_dir", str(tmp_path / "model"), "has no prepare_hidden_states.py"),
        ("pipeline_scripts_dir", str(tmp_path / "nowhere"), "does not exist on this host"),
    ]
    if action == "launch":
        (tmp_path / "file").touch()
        cases.append(("output_dir", str(tmp_path / "file" / "out"), "is not a directory"))
    for field, value, words in cases:
        form = {"csrf_token": c.headers["x-csrf-token"], "action": action, **fields, field: value}
        r = c.post("/runs/new", data=form)
        assert r.status_code == 422, (field, value, r.text[-2000:])
        marked = re.search(rf'<p class="field-error" id="err-{field}" role="alert">([^<]*)</p>', r.text)
        assert marked is not None and words in marked.group(1), (field, value, r.text[-3000:])
        assert 'aria-invalid="true"' in r.text
    assert c.get("/api/runs").json() == []


def test_the_api_names_the_field(c: httpx.Client, tmp_path: Path) -> None:
    spec = {**usable(tmp_path), "specforge": {"scripts_dir": str(tmp_path / "none")}}
    del spec["pipeline_scripts_dir"]
    r = c.post("/api/runs", json=spec)
    assert r.status_code == 422
    assert [e["field"] for e in r.json()["errors"]] == ["specforge.scripts_dir"], r.text
    assert c.get("/api/runs").json() == []
