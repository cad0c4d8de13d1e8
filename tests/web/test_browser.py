"""End to end in Debian's headless Chromium: real uvicorn, real Controller, real local agent and job.

The job is a stand-in for vLLM (no GPU here): a Python script printing vLLM's real milestone lines and
writing a capture file whose hidden dimension is wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import AgentHost, LiveServer, screenshot, wait_until

JOB = str(Path(__file__).with_name("fake_vllm_job.py"))
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=2;alert(1)</script> javascript:alert(3)'
pytestmark = [pytest.mark.browser, pytest.mark.slow]
NOTIFY_STUB = """
window.__notes = [];
window.Notification = class { constructor(title, opts) { window.__notes.push([title, opts.body]); } };
window.Notification.permission = "granted";
window.Notification.requestPermission = () => Promise.resolve("granted");
Object.defineProperty(document, "hidden", { get: () => true });
"""


@pytest.fixture
def page(agent_host: AgentHost, live_server: LiveServer, browser: Any) -> Iterator[Any]:
    """A page on the live server with the local agent host registered; records any dialog that opens."""
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        r = c.post(
            "/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)}
        )
        assert r.status_code == 201
        wait_until(lambda: c.get("/api/hosts/local").json()["reachable"], 30, what="agent reachable")
    # CSP is bypassed so Playwright may evaluate its wait predicates; this also means the XSS test shows
    # that escaping alone keeps payloads inert (the CSP header is asserted in test_api).
    ctx = browser.new_context(
        base_url=live_server.url, viewport={"width": 1280, "height": 900}, bypass_csp=True
    )
    pg = ctx.new_page()
    pg.dialogs = []  # type: ignore[attr-defined]
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.js_errors = errors  # type: ignore[attr-defined]
    try:
        yield pg
    finally:
        ctx.close()


def fill_command_form(page: Any, out: Path, argv: list[str], name: str) -> None:
    """Fill the New-run form for a backend 'command' run."""
    page.goto("/runs/new")
    page.fill("#f-name", name)
    page.select_option("#f-host", "local")
    page.select_option("#f-backend", "command")
    page.fill("#f-output_dir", str(out))
    page.fill("#f-command", "\n".join(argv))
    page.fill("#f-expect_layers", "4")
    page.fill("#f-expect_hidden_size", "64")


def test_start_watch_alert_stop(page: Any, live_server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, JOB, str(out), "--progress", "20", "--delay", "0.5", "--broken", "--hang"]
    # invalid input first: errors next to the field, nothing launched
    fill_command_form(page, out, argv, "ui-run")
    page.fill("#f-layers", "2, x")
    page.fill("#f-tensor_parallel_size", "0")
    page.click("button[value=launch]")
    assert page.locator("#err-layers").inner_text().startswith("layer ids must be whole numbers")
    assert page.locator("#err-tensor_parallel_size").is_visible()
    screenshot(page, "new-run-errors")
    with httpx.Client(base_url=live_server.url) as c:
        assert c.get("/api/runs").json() == []
    dash = page.context.new_page()  # a dashboard left open: the new run must show up there live
    # Notification stand-in (headless Chromium shows none): permission granted, tab in the background.
    dash.add_init_script(NOTIFY_STUB)
    dash.goto("/")
    dash.wait_for_selector("#live-status[data-state=live]")
    page.fill("#f-layers", "")
    page.fill("#f-tensor_parallel_size", "1")
    page.click("button[value=launch]")
    page.wait_for_url("**/runs/r-*")
    page.evaluate("window.__noReload = 1")
    page.wait_for_selector("#live-status[data-state=live]")
    # pause holds new log lines back; resume shows them (while the job still prints a line every 0.5 s)
    page.wait_for_function("document.querySelectorAll('#log .ln').length >= 8", timeout=30000)
    page.click("#log-pause")
    # lines that came before the click are drawn in the frame after it: count once that frame says paused
    page.wait_for_function("/paused/.test(document.getElementById('log-info').innerText)")
    held = page.locator("#log .ln").count()
    # the job keeps printing: wait until the info line counts lines held back, then none was shown
    page.wait_for_function("/paused, [0-9]+ new/.test(document.getElementById('log-info').innerText)")
    assert page.locator("#log .ln").count() == held
    page.click("#log-pause")
    page.wait_for_function(f"document.querySelectorAll('#log .ln').length > {held}", timeout=20000)
    # milestones appear without a reload
    page.wait_for_function("document.querySelectorAll('#timeline li[data-seq]').length >= 6", timeout=30000)
    first = page.locator("#timeline li[data-seq]").count()
    page.wait_for_function(
        f"document.querySelectorAll('#timeline li[data-seq]').length > {first}", timeout=30000
    )
    assert page.evaluate("window.__noReload") == 1
    kinds = page.locator("#timeline .kind").all_inner_texts()
    assert {"engine_config", "weights_loaded", "kv_cache_ready", "engine_ready"} <= set(kinds)
    assert "12.52" in page.locator("#timeline").inner_text()  # GiB loaded, shown as a field
    # the shape check alert banner
    page.wait_for_selector("#alert-banner:not([hidden])", timeout=40000)
    assert "shape check failed" in page.locator("#alert-banner").inner_text()
    page.wait_for_selector("#checks tr.bad", timeout=20000)
    assert "no layer axis" in page.locator("#checks").inner_text()
    page.fill("#log-q", "wrote hs_0")  # search (server-side over the stored log, then live)
    page.wait_for_function("document.querySelectorAll('#log .ln').length === 1", timeout=10000)
    assert "wrote hs_0.safetensors" in page.locator("#log").inner_text()
    page.fill("#log-q", "")
    page.wait_for_function("document.querySelectorAll('#log .ln').length > 5", timeout=10000)
    page.wait_for_function("document.querySelectorAll('#log .ln').length > 5")
    assert page.evaluate("window.__noReload") == 1
    screenshot(page, "run-live")
    dash.wait_for_selector("tr[data-run] [data-field=state]:text('running')", timeout=30000)
    dash.wait_for_function(
        "document.querySelector('tr[data-run] [data-field=open_alerts]').textContent === '1'"
    )
    # stop, with confirmation
    page.click("#stop summary")
    page.click("#stop-confirm")
    page.wait_for_selector("#verdict:not([hidden])", timeout=30000)
    page.wait_for_function("document.querySelector('.run-head [data-field=state]').textContent === 'stopped'",
                           timeout=30000)  # fmt: skip
    assert "Stopped" in page.locator("#verdict").inner_text()
    screenshot(page, "run-stopped")
    dash.wait_for_selector("tr[data-run] [data-field=state]:text('stopped')", timeout=30000)
    notes = dash.evaluate("window.__notes")
    assert any("shape_check_failed" in title and "no layer axis" in body for title, body in notes), notes
    dash.close()
    page.goto("/")
    assert page.locator("tr[data-run] [data-field=state]").first.inner_text() == "stopped"
    assert "reachable" in page.locator("article[data-host=local]").inner_text()
    route = page.locator("article[data-host=local] [data-field=link_route]").inner_text()
    assert route == "link: local-pipes"
    screenshot(page, "dashboard")
    page.goto("/alerts")
    assert "shape_check_failed" in page.locator("#alerts").inner_text()
    screenshot(page, "alerts")
    page.locator("#alerts tr[data-alert] button", has_text="Acknowledge").first.click()
    assert "acknowledged" in page.locator("#alerts").inner_text()
    assert page.dialogs == [] and page.js_errors == []


def test_hostile_log_and_spec_values_stay_inert(page: Any, live_server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, JOB, str(out), "--progress", "2", "--delay", "0.3", "--payload", XSS, XSS]
    fill_command_form(page, out, argv, "xss-run")
    page.fill("#f-env", "NOTE=" + XSS + "\nHF_TOKEN=hf_supersecret")
    page.click("button[value=launch]")
    page.wait_for_url("**/runs/r-*")
    run_url = page.url
    page.wait_for_function("document.querySelectorAll('#log .ln').length >= 9", timeout=30000)
    page.wait_for_function(
        "[...document.querySelectorAll('#timeline .ms-warning')].length >= 1", timeout=30000
    )
    assert XSS in page.locator("#log").inner_text()  # shown as text, live (JS) path
    assert XSS in page.locator("#timeline").inner_text()
    # only errors: the three lines carrying the payload (its "onerror" counts) and none of vLLM's INFO lines
    page.check("#log-errors")
    page.wait_for_function("document.querySelectorAll('#log .ln').length === 3", timeout=10000)
    shown = page.locator("#log .ln").all_inner_texts()
    assert all("error" in t.lower() for t in shown) and any(t.startswith("ERROR <img") for t in shown)
    page.uncheck("#log-errors")
    page.wait_for_function("document.querySelectorAll('#log .ln').length >= 9", timeout=10000)
    # reload: the server-rendered path
    with httpx.Client(base_url=live_server.url) as c:
        wait_until(lambda: c.get(run_url).status_code == 200 and "completed" in c.get(run_url).text, 30)
        html = c.get(run_url).text
    assert "<script>window.__xss" not in html and "<img src=x" not in html
    assert "hf_supersecret" not in html
    page.reload()
    page.wait_for_selector("#log .ln")
    assert XSS in page.locator(".spec").inner_text()
    assert XSS in page.locator("#log").inner_text()
    assert "hf_supersecret" not in page.content()
    screenshot(page, "run-xss")
    page.goto("/")
    assert page.evaluate("window.__xss") is None
    assert page.dialogs == [] and page.js_errors == []


def test_pages_work_under_the_real_csp(agent_host: AgentHost, live_server: LiveServer, browser: Any) -> None:
    """Without bypass_csp: our own JS (SSE, virtual log, charts) runs under the CSP without violations."""
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        c.post("/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)})
        spec = {
            "host": "local",
            "backend": "command",
            "command": [sys.executable, JOB, "/tmp/unused", "--delay", "0"],
        }
        run_id = c.post("/api/runs", json=spec).json()["id"]
    ctx = browser.new_context(base_url=live_server.url)
    pg = ctx.new_page()
    console: list[str] = []
    pg.on("console", lambda m: console.append(m.text))
    pg.on("pageerror", lambda e: console.append(str(e)))
    for path in ("/", "/runs/new", "/alerts", f"/runs/{run_id}"):
        pg.goto(path)
        if path != "/runs/new":  # the form page has no live feed
            live = "#live-status[data-state=live], #live-status[data-state=finished]"
            pg.wait_for_selector(live, timeout=20000)
    pg.wait_for_selector("#log.virtual .ln", timeout=20000)
    pg.wait_for_selector("#chart-progress polyline", state="attached", timeout=20000)
    ctx.close()
    assert not [m for m in console if "Content Security Policy" in m or "Refused" in m], console
