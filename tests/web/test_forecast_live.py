"""The disk forecast through the controller and a real local agent: `POST /api/forecast` and the form."""

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


def _paths(tmp_path: Path) -> dict[str, str]:
    model = tmp_path / "model"
    model.mkdir()
    cfg = {"num_hidden_layers": 8, "hidden_size": 32, "torch_dtype": "bfloat16"}
    (model / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "data.jsonl"
    data.write_text('{"token_ids": [1, 2, 3]}\n')
    return {"model": str(model), "dataset": str(data), "output_dir": str(tmp_path / "out")}


def test_api_forecast(c: httpx.Client, tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    r = c.post("/api/forecast", json={"host": "local", **paths})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["bytes"] == 256 + 3 * (8 + 4 * 32 * 2) and got["fits"] is True and got["estimated"] is False
    assert c.get("/api/runs").json() == []  # nothing launched
    r = c.post("/api/forecast", json={"host": "local", **paths, "dataset": str(tmp_path / "none.jsonl")})
    assert r.status_code == 422 and "does not exist" in r.json()["message"]


def test_form_forecast_button(c: httpx.Client, tmp_path: Path) -> None:
    form = {"csrf_token": c.headers["x-csrf-token"], "action": "forecast", "host": "local",
            "backend": "worker-extension", **_paths(tmp_path)}  # fmt: skip
    r = c.post("/runs/new", data=form)
    assert r.status_code == 200, r.text
    text = re.sub(r"\s+", " ", r.text)
    assert (
        'id="forecast"' in text
        and "Forecast: 1.0 KiB to write" in text
        and "fits (with a 10 % margin)" in text
    )
    assert c.get("/api/runs").json() == []


def test_api_forecast_of_a_speculators_run(c: httpx.Client, tmp_path: Path) -> None:
    """speculators' --preprocessed-data is a folder saved by datasets: read as its client reads it."""
    from datasets import Dataset

    paths = _paths(tmp_path)
    data = tmp_path / "prep"
    Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]}).save_to_disk(str(data))
    spec = {"host": "local", **paths, "dataset": str(data), "backend": "speculators"}
    r = c.post("/api/forecast", json=spec)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (
        got["bytes"] == 2 * 256 + 5 * (8 + 4 * 32 * 2) and got["fits"] is True and got["estimated"] is False
    )
    r = c.post("/api/forecast", json={**spec, "dataset": paths["dataset"]})  # a JSONL file is not its format
    assert r.status_code == 422 and "not a directory saved by datasets" in r.json()["message"]
    assert c.get("/api/runs").json() == []


def test_form_forecast_button_for_a_specforge_run(c: httpx.Client, tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    Path(paths["dataset"]).write_text(
        json.dumps({"conversations": [{"role": "user", "content": "hi"}]}) + "\n"
    )  # no tokenizer in the model folder: the row counts seq_len tokens at most
    scripts = tmp_path / "SpecForge" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "prepare_hidden_states.py").touch()
    form = {"csrf_token": c.headers["x-csrf-token"], "action": "forecast", "host": "local",
            "backend": "specforge", "seq_len": "64", "pipeline_scripts_dir": str(scripts),
            **paths}  # fmt: skip
    r = c.post("/runs/new", data=form)
    assert r.status_code == 200, r.text
    text = re.sub(r"\s+", " ", r.text)
    # 2560 + 64 × (16 + 4 × 32 × 2) = 19968 bytes
    assert 'id="forecast"' in text and "Forecast: 19.5 KiB to write (an estimate" in text, text[-3000:]
    assert c.get("/api/runs").json() == []
