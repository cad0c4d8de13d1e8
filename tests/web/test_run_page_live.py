"""The run page watched live in headless Chromium ends as the reloaded page shows it, and stays within the
window. A stand-in job (fake_vllm_job.py: vLLM's log lines, the extraction job's capture lines, files) stands
in for the vLLM engine; the real agent checks its files."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import AgentHost, LiveServer, screenshot, wait_until

JOB = str(Path(__file__).with_name("fake_vllm_job.py"))
pytestmark = [pytest.mark.browser, pytest.mark.slow]
#: The parts of the run page that a run's end changes.
PARTS = ("#run-head", "#capture-card", "#layer-stats", "#verdict", "#checks-card", "#milestones-card")
SNAPSHOT = """parts => parts.map(sel => {
  const e = document.querySelector(sel);
  if (!e) return sel + ": absent";
  const chart = e.querySelector('#chart-layers');
  return sel + (e.hidden ? " hidden" : "") + ": " + e.innerText.replace(/\\s+/g, " ").trim() +
    (chart ? " points=" + (chart.dataset.points || "0") : "");
})"""


def launch(live_server: LiveServer, agent_host: AgentHost, out: Path, *flags: str) -> str:
    argv = [
        sys.executable,
        JOB,
        str(out),
        "--capture",
        "--layer-rms",
        "--progress",
        "4",
        "--delay",
        "0.4",
        *flags,
    ]
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        if not c.get("/api/hosts").json():
            c.post(
                "/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)}
            )
        spec = {"name": out.name, "host": "local", "backend": "command", "command": argv,
                "output_dir": str(out), "expect": {"layers": 2, "hidden_size": 64}}  # fmt: skip
        r = c.post("/api/runs", json=spec)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


def readable_milestones(page: Any, passed: int) -> None:
    """The engine configuration in one row, its lines on demand; passed checks as a count; vLLM's engine
    shutdown after completion marked normal; a time axis since the start; no GPU panel on a CPU host."""
    engine = page.locator("#timeline li.ms-engine_config")
    assert engine.count() == 1 and "vLLM 0.19.1" in engine.locator("summary").inner_text()
    assert not engine.locator(".member").first.is_visible()
    engine.locator("summary").click()
    assert "model=/models/tiny" in engine.locator(".member").first.inner_text().replace("'", "")
    assert page.locator("#timeline li.ms-shape_check_passed").count() == (1 if passed else 0)
    if passed:
        assert (
            page.locator("#timeline li.ms-shape_check_passed summary").inner_text()
            == f"{passed} files passed"
        )
        assert page.locator("#checks [data-field=passed]").inner_text() == f"{passed} files passed"
    else:  # problems first: the failed checks above no count of passed ones
        assert page.locator("#checks [data-field=passed]").count() == 0
    shutdown = page.locator("#timeline li.ms-warning.ms-normal")
    assert "normal: vLLM shutting down after the run completed" in shutdown.inner_text()
    page.locator("#chart-layers .u-over").hover()  # the legend tells the time under the cursor
    when = page.locator("#chart-layers .u-legend .u-series").first.inner_text()
    assert re.fullmatch(r"since start\s*\+[\d.]+s", when.strip()), when
    assert page.locator("#chart-gpu").count() == 0


def snapshot(page: Any) -> list[str]:
    return list(page.evaluate(SNAPSHOT, list(PARTS)))


def live_equals_reload(live: Any, run_id: str, timeout_s: float) -> list[str]:
    """Wait until ``live`` (opened at launch, never reloaded) shows the run's end and equals the page loaded
    afresh: header and verdict badge, capture card, charts, verdict, problems, milestones. The fresh parts."""
    live.wait_for_selector("#verdict:not([hidden])", timeout=timeout_s * 1000)
    fresh = live.context.new_page()
    try:
        fresh.goto(f"/runs/{run_id}")
        fresh.wait_for_selector("#live-status[data-state=finished]", timeout=30000)
        want = snapshot(fresh)
    finally:
        fresh.close()
    wait_until(lambda: snapshot(live) == want, 20, what="the live page equal to the reloaded one")
    assert live.evaluate("window.__noReload") == 1
    return want


def no_sideways_scroll(page: Any) -> bool:
    return bool(page.evaluate("document.documentElement.scrollWidth <= 1280"))


@pytest.mark.parametrize("files", ["good", "drop-layer"])
def test_live_page_ends_as_the_reloaded_one(
    agent_host: AgentHost, live_server: LiveServer, browser: Any, tmp_path: Path, files: str
) -> None:
    """Watched from launch to end without a reload: the same header, card, chart, verdict, checks and
    milestones as the page loaded afresh; the shapes read shown beside the configured ones."""
    ctx = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    live = ctx.new_page()
    errors: list[str] = []
    live.on("pageerror", lambda e: errors.append(str(e)))
    try:
        run_id = launch(live_server, agent_host, tmp_path / "out", "--files", files, "--shutdown")
        live.goto(f"/runs/{run_id}")  # from launch to end, never reloaded
        live.evaluate("window.__noReload = 1")
        want = live_equals_reload(live, run_id, 60)
        assert no_sideways_scroll(live)
        fresh = ctx.new_page()
        fresh.goto(f"/runs/{run_id}")
        fresh.wait_for_selector("#live-status[data-state=finished]", timeout=30000)
        head = want[0]
        assert head.startswith("#run-head: out") and "completed" in head, head
        assert ("files ok" if files == "good" else "problems") in head, head
        card = next(w for w in want if w.startswith("#capture-card"))
        assert "vLLM 0.19.1 Layers configured 2, 4" in card and "Hidden size configured 64" in card, card
        read = f"hidden_states [T, {2 if files == 'good' else 1}, 64]"
        assert f"token_ids [T], {read} expected hidden_states [T, 2, 64]" in card, card
        assert read in next(w for w in want if w.startswith("#checks-card"))
        assert "No per-layer statistics yet" not in " ".join(want)
        for page in (live, fresh):  # what a person reads, watched live and reloaded
            readable_milestones(page, passed=4 if files == "good" else 0)
        screenshot(live, f"run-live-end-{files}")
    finally:
        ctx.close()
    assert not errors, errors


def test_long_lines_stay_within_the_window(
    agent_host: AgentHost, live_server: LiveServer, browser: Any, tmp_path: Path
) -> None:
    """A 3,000-character log line and milestone wrap or are cut with their whole text on hover."""
    payload = "x" * 1500 + "/" + "y" * 1500
    ctx = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    try:
        run_id = launch(live_server, agent_host, tmp_path / "out", "--payload", payload, "--delay", "0.8")
        page.goto(f"/runs/{run_id}")
        page.wait_for_selector("#timeline .ms-warning", timeout=30000)
        assert no_sideways_scroll(page)  # while it runs
        page.wait_for_selector("#verdict:not([hidden])", timeout=60000)
        for _ in range(2):  # at its end, live, then reloaded
            assert no_sideways_scroll(page)
            assert payload in page.locator("#timeline").inner_text()
            page.wait_for_selector(f'#log .ln[title="{payload}"]', state="attached", timeout=20000)
            page.reload()
            page.wait_for_selector("#timeline .ms-warning", timeout=30000)
        screenshot(page, "run-long-lines")
    finally:
        ctx.close()
