"""A sharded run from the New-run form (host multi-select, Shards) and its shard table, in headless Chromium.

The shards' jobs fail at once (the model directory's config.json is empty: no engine starts; a path the host
lacks would be refused before launch), which is all the table needs: two rows with host and state, one
verdict, and a Resume button per failed shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import AgentHost, LiveServer, wait_until
from tests.web.test_browser import page  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_sharded_run_from_the_form_and_its_shard_table(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    agent_host: AgentHost,
    tmp_path: Path,
) -> None:
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        second = {"name": "local2", "ssh": "local", "state_dir": str(agent_host.state_dir)}
        assert c.post("/api/hosts", json=second).status_code == 201
    model = tmp_path / "no-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"token_ids": [1, 2, 3]}\n')
    page.goto("/runs/new")
    page.fill("#f-name", "sharded")
    page.select_option("#f-host", ["local", "local2"])
    page.fill("#f-model", str(model))
    page.fill("#f-dataset", str(tmp_path / "data.jsonl"))
    page.fill("#f-output_dir", str(tmp_path / "out"))
    page.fill("#f-shards", "1")
    page.click("button[value=launch]")  # two hosts, one shard: refused next to the field
    assert "shards is 1 but 2 hosts are given" in page.locator("#err-shards").inner_text()
    page.fill("#f-shards", "2")
    page.click("button[value=launch]")
    page.wait_for_url("**/runs/r-*")
    run_id = page.url.rsplit("/", 1)[1]
    with httpx.Client(base_url=live_server.url) as c:
        run = wait_until(
            lambda: (r := c.get(f"/api/runs/{run_id}").json())["state"] == "failed" and r,
            60,
            what="both shards failed",
        )
    assert run["spec"]["host"] == ["local", "local2"] and run["verdict"] == "failed"
    assert [(s["index"], s["host"], s["state"]) for s in run["shards"]] == [
        (0, "local", "failed"),
        (1, "local2", "failed"),
    ]
    # the rows reach both failures without a reload (live from run events when rendered earlier)
    page.wait_for_function(
        """() => [...document.querySelectorAll('#shards [data-field="state"]')]
                 .map(b => b.textContent).join() === 'failed,failed'""",
        timeout=30000,
    )
    page.reload()
    rows = page.locator("#shards tbody tr")
    assert rows.count() == 2
    assert "local2" in rows.nth(1).inner_text() and "failed" in rows.nth(1).inner_text()
    assert page.locator("[data-resume-shard]").count() == 2
    page.click("[data-resume-shard='1']")  # the run has ended: a new run carries shard 0 and retries 1
    page.wait_for_url(lambda url: run_id not in url)
    new_id = page.url.rsplit("/", 1)[1]
    with httpx.Client(base_url=live_server.url) as c:
        again = c.get(f"/api/runs/{new_id}").json()
        assert again["resumed_from"] == run_id
        assert [(s["index"], s["attempts"]) for s in again["shards"]] == [(0, 1), (1, 2)]
        assert again["shards"][0]["job_id"] == run["shards"][0]["job_id"]
        assert [r["id"] for r in c.get("/api/runs").json()] == [new_id, run_id]  # jobs are not listed
