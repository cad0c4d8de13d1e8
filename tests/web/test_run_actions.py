"""Run again and Resume from a run's page, in headless Chromium against a real uvicorn and a local agent."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import LiveServer, screenshot, wait_until
from tests.web.test_browser import page  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@contextlib.contextmanager
def _api(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        yield c


def test_run_again_and_resume(page: Any, live_server: LiveServer, tmp_path: Path) -> None:  # noqa: F811
    out, model = tmp_path / "out", tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 32}))
    (tmp_path / "data.jsonl").write_text("{}\n")
    spec = {  # expect.hidden_size 1: the job's preflight refuses it, so the run fails at once
        "name": "resumable", "host": "local", "backend": "worker-extension", "model": str(model),
        "dataset": str(tmp_path / "data.jsonl"), "output_dir": str(out), "max_samples": 3,
        "env": {"HF_TOKEN": "s3cret-value", "A": "1"}, "expect": {"hidden_size": 1},
    }  # fmt: skip
    with _api(live_server) as c:
        old = c.post("/api/runs", json=spec).json()["id"]
        wait_until(lambda: c.get(f"/api/runs/{old}").json()["state"] == "failed", 60, what="run failed")
        cmd = c.post(
            "/api/runs",
            json={
                "name": "cmd",
                "host": "local",
                "backend": "command",
                "command": [sys.executable, "-c", "1"],
            },
        ).json()["id"]
        wait_until(lambda: c.get(f"/api/runs/{cmd}").json()["state"] == "completed", 60, what="cmd done")
        assert c.post(f"/api/runs/{cmd}/resume").status_code == 409

    # Run again: the form comes back filled with the run's spec, secret values left for the user to type
    page.goto(f"/runs/{old}")
    page.click("#run-again")
    page.wait_for_url("**/runs/new?again=*")
    assert page.input_value("#f-output_dir") == str(out)
    assert page.input_value("#f-model") == str(model)
    assert page.input_value("#f-max_samples") == "3" and page.input_value("#f-name") == "resumable"
    assert page.input_value("#f-backend") == "worker-extension" and page.input_value("#f-host") == "local"
    env = page.input_value("#f-env")
    assert "A=1" in env and "HF_TOKEN=" in env and "s3cret-value" not in page.content()
    assert old in page.locator("#again-notice").inner_text()

    # Resume: a new run, linked both ways, same output directory
    page.goto(f"/runs/{old}")
    page.click("#resume button")
    page.wait_for_url(lambda url: "/runs/r-" in url and old not in url)
    new = page.url.rsplit("/", 1)[1]
    assert old in page.locator("#resumes").inner_text()
    with _api(live_server) as c:
        detail = c.get(f"/api/runs/{new}").json()
    assert detail["resumed_from"] == old and detail["spec"]["output_dir"] == str(out)
    page.goto(f"/runs/{old}")
    assert new in page.locator("#resumed-by").inner_text()
    assert page.locator("#resume").count() == 0  # resumed once: its resume is the run to resume now
    screenshot(page, "run-resumed")
    page.goto(f"/runs/{cmd}")
    assert page.locator("#resume").count() == 0 and page.locator("#run-again").count() == 1
    assert page.dialogs == [] and page.js_errors == []
