"""The run page's layer RMS chart and capture card in headless Chromium under the real CSP: vendored uPlot,
live points, live counts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import AgentHost, LiveServer, screenshot, wait_until

JOB = str(Path(__file__).with_name("fake_vllm_job.py"))
pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_layer_rms_chart_draws_and_grows_live(
    agent_host: AgentHost, live_server: LiveServer, browser: Any, tmp_path: Path
) -> None:
    argv = [
        sys.executable,
        JOB,
        str(tmp_path / "out"),
        "--layer-rms",
        "--capture",
        "--progress",
        "6",
        "--delay",
        "0.6",
    ]
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        c.post("/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)})
        spec = {"host": "local", "backend": "command", "command": argv}
        run_id = c.post("/api/runs", json=spec).json()["id"]
        # a watched command gets the section once its first layer_rms is stored; later points come live
        wait_until(
            lambda: any(m["kind"] == "progress" for m in c.get(f"/api/runs/{run_id}").json()["milestones"]),
            30,
            what="first progress milestone",
        )
    ctx = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    console: list[str] = []
    pg.on("console", lambda m: console.append(m.text))
    pg.on("pageerror", lambda e: console.append(str(e)))
    try:
        pg.goto(f"/runs/{run_id}")
        pg.wait_for_selector(
            "#live-status[data-state=live], #live-status[data-state=finished]", timeout=20000
        )
        # no wait_for_function: under the real CSP Playwright may not eval a predicate in the page
        pg.wait_for_selector('#chart-layers[data-points="6"]', state="attached", timeout=30000)
        pg.wait_for_selector("#chart-layers canvas", state="attached")
        labels = pg.locator("#chart-layers .u-legend .u-label").all_inner_texts()
        assert [t for t in labels if t.startswith("layer")] == ["layer 2", "layer 4"]
        assert pg.locator("#chart-layers-empty").is_hidden()
        # the capture card counted along: the job's totals once it completed
        pg.wait_for_selector('[data-card="so-far"][hidden]', state="attached", timeout=20000)  # final
        assert pg.locator('[data-card="tokens"]').inner_text() == "6,000"
        card = {k: pg.locator(f'[data-card="{k}"]').inner_text() for k in ("files", "bytes", "eta", "layers")}
        assert card == {
            "files": "6",
            "bytes": "18.0 MiB",
            "eta": "—",
            "layers": "2, 4 (input: the residual stream entering each layer)",
        }
        screenshot(pg, "run-layer-rms")
        pg.reload()  # and from the stored milestones alone
        pg.wait_for_selector('#chart-layers[data-points="6"]', state="attached", timeout=20000)
    finally:
        ctx.close()
    assert not [m for m in console if "Content Security Policy" in m or "Refused" in m or "Error" in m], (
        console
    )
