"""Live run page in headless Chromium: milestones and log lines stream into the DOM, in order, each once.

Real uvicorn, Controller, local agent and job (the job is the vLLM stand-in: no GPU here).  The page adds a
milestone's <li> at once and leaves trimming, scrolling and charts to the next frame; the log view adds
and drops only the rows that enter or leave its window.  These check that what ends up on screen is
still exactly right.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import LiveServer, wait_until
from tests.web.test_browser import JOB, page  # noqa: F401  (the page fixture)

pytestmark = [pytest.mark.browser, pytest.mark.slow]
PROGRESS = 70
#: The log rows on screen: offsets ascending and tops contiguous (one row every 18 px), no duplicates.
ROWS = """() => Array.from(document.querySelectorAll('#log .ln'))
  .map(d => [Number(d.dataset.offset), parseInt(d.style.top, 10)])"""
FRAME = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"


def covered(pg: Any) -> bool:
    """The rows on screen are the view's window: from 20 rows above what is visible to past its bottom."""
    top, height = pg.evaluate(
        "() => { const b = document.getElementById('log'); return [b.scrollTop, b.clientHeight]; }"
    )
    tops = [t for _, t in pg.evaluate(ROWS)]
    return bool(tops) and tops[0] == max(0, top // 18 - 20) * 18 and tops[-1] + 18 >= top + height


def contiguous(rows: list[list[int]]) -> bool:
    """Rows in offset order whose tops follow one another without a gap."""
    offsets = [o for o, _ in rows]
    tops = [t for _, t in rows]
    return (
        bool(rows)
        and offsets == sorted(set(offsets))
        and tops == list(range(tops[0], tops[0] + 18 * len(rows), 18))
    )


def test_milestones_and_log_rows_stream_in_order(page: Any, live_server: LiveServer, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "out"
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        spec = {"name": "live-dom", "host": "local", "backend": "command", "output_dir": str(out),
                "command": [sys.executable, JOB, str(out), "--progress", str(PROGRESS), "--delay", "0.03",
                            "--flood", "600", "--hang", "--payload", "<b>not bold</b>"]}  # fmt: skip
        r = c.post("/api/runs", json=spec)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        page.goto(f"/runs/{run_id}")
        page.wait_for_selector("#live-status[data-state=live]")

        def stored() -> Any:
            d = c.get(f"/api/runs/{run_id}").json()
            done = [m for m in d["milestones"] if m["kind"] == "progress"]
            log = c.get(f"/api/runs/{run_id}/log", params={"after": -1, "limit": 5000}).json()
            return (d, log) if len(done) == PROGRESS and len(log) > 600 else None

        run, lines = wait_until(stored, 60, what="every progress milestone and log line stored")
        total = len(run["milestones"])
        page.wait_for_function(f"window.__ew.milestones === {total}", timeout=30000)
        page.wait_for_function(
            f"document.getElementById('log-info').textContent.startsWith('{len(lines):,} lines')"
        )
        page.evaluate(FRAME)
        # each milestone once, in order; old progress entries trimmed (they live on in the chart)
        done = page.eval_on_selector_all(
            "#timeline li.ms-progress", "els => els.map(e => Number(e.dataset.seq))"
        )
        assert len(done) == 20 and done == sorted(set(done))
        assert page.locator("#milestone-count").inner_text() == str(total)
        # the chart is redrawn at most once a second: the newest samples come within that second
        page.wait_for_function(
            "(document.querySelector('#chart-progress polyline')?.getAttribute('points') || '')"
            ".split(' ').length > 2",
            timeout=5000,
        )
        # the timeline follows its newest entry
        assert page.eval_on_selector("#timeline", "t => t.scrollTop + t.clientHeight >= t.scrollHeight - 2")
        # the log: the window's rows, the last line at the bottom, hostile text as text
        rows = page.evaluate(ROWS)
        assert contiguous(rows) and rows[-1][0] == lines[-1]["offset"]
        # scrolled up a little (rows come in above), far (a new window), down a little, back to the end
        for where in (
            "box.scrollTop - 180",
            "box.scrollTop - 400",
            "0",
            "box.scrollTop + 300",
            "box.scrollHeight",
        ):
            page.evaluate(f"() => {{ const box = document.getElementById('log'); box.scrollTop = {where}; }}")
            page.evaluate(FRAME)
            rows = page.evaluate(ROWS)
            assert contiguous(rows) and covered(page), (where, rows)
            if where == "0":  # the job's hostile line, near the top, shown as text
                assert rows[0] == [lines[0]["offset"], 0]
                assert page.locator("#log b").count() == 0
                assert "<b>not bold</b>" in page.locator("#log").inner_text()
        assert rows[-1][0] == lines[-1]["offset"] and rows[0][1] > 0
        c.post(f"/api/runs/{run_id}/stop")
    assert page.dialogs == [] and page.js_errors == []


#: Counts the progress chart's redraws (each one replaces the SVG's children).
CHART_DRAWS = """() => {
  window.__draws = 0;
  new MutationObserver(() => { window.__draws += 1; })
    .observe(document.getElementById('chart-progress'), {childList: true});
}"""
TOKENS_POINTS = """(n) => { const p = document.querySelector('#chart-progress polyline.s2');
  return p !== null && p.getAttribute('points').split(' ').length === n; }"""


def test_progress_chart_redraws_at_most_once_a_second_and_catches_up(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    tmp_path: Path,
) -> None:
    """Milestones shown one after another as fast as they come: their <li>s go in at once, the chart (a
    rebuild from every sample) follows at most once a second and then holds every sample."""
    n = 20
    fifo = tmp_path / "wake"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        spec = {"name": "chart", "host": "local", "backend": "command", "output_dir": str(out),
                "command": [sys.executable, JOB, str(out), "--progress", str(n), "--wait-fifo", str(fifo),
                            "--hang"]}  # fmt: skip
        r = c.post("/api/runs", json=spec)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        page.goto(f"/runs/{run_id}")
        page.wait_for_selector("#live-status[data-state=live]")
        page.evaluate(CHART_DRAWS)
        wake = os.open(fifo, os.O_WRONLY)  # the job opens it before its first progress line
        try:
            start = time.monotonic()
            for i in range(1, n + 1):
                os.write(wake, b"\n")
                page.wait_for_function(
                    f"document.querySelectorAll('#timeline li.ms-progress').length >= {i}", timeout=20000
                )
            took = time.monotonic() - start
        finally:
            os.close(wake)
        page.wait_for_function(TOKENS_POINTS, arg=n, timeout=5000)
        draws = page.evaluate("window.__draws")
        # one right away, then one a second at most (the last one within a second of the last sample)
        assert 1 <= draws <= 2 + int(took), (draws, took)
        c.post(f"/api/runs/{run_id}/stop")
    assert page.dialogs == [] and page.js_errors == []
