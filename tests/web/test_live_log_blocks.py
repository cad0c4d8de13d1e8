"""The run page reads live log lines as blocks from its events stream and splits them itself: in headless
Chromium each row carries the offset and text the API stores, for multi-byte text (natural offsets worked
out in the page) and for replaced bytes and CRLF endings (offsets sent), markup stays text, and a reload
shows the same rows."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import LiveServer, wait_until
from tests.web.test_browser import page  # noqa: F401  (the page fixture)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

#: Waits for its go file (so the page is live first), writes awkward lines, then waits to be stopped.
JOB = """\
import os, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.02)
out = sys.stdout.buffer
out.write("plain\\n\\u00fcn\\u00efcode \\u20ac\\n\\U0001f985 eagle \\u00e9\\n".encode())
out.write(b"<b>not bold</b> & <i>x</i>\\n")
out.flush()
time.sleep(0.3)  # a second block, whose lines need the offsets sent
out.write(b"bad \\xff\\xfe byte\\ncrlf line\\r\\n\\nlast \\xe2\\x82\\xac\\n")
out.flush()
while True:
    time.sleep(1)
"""
#: The rows of the log view as (offset, text).
ROWS = """() => Array.from(document.querySelectorAll('#log .ln'))
  .map(d => [Number(d.dataset.offset), d.textContent])"""


def test_live_log_blocks_land_with_the_stored_offsets(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    tmp_path: Path,
) -> None:
    job, go = tmp_path / "job.py", tmp_path / "go"
    job.write_text(JOB)
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        spec = {
            "name": "blocks",
            "host": "local",
            "backend": "command",
            "command": [sys.executable, str(job), str(go)],
        }
        r = c.post("/api/runs", json=spec)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        page.goto(f"/runs/{run_id}")
        page.wait_for_selector("#live-status[data-state=live]")
        go.write_text("")
        stored = wait_until(
            lambda: (
                (got := c.get(f"/api/runs/{run_id}/log", params={"after": -1}).json())
                and len(got) >= 8
                and got
            ),
            30,
            what="the job's lines stored",
        )
        want = [[ln["offset"], ln["text"]] for ln in stored]
        assert want[1] == [6, "ünïcode €"] and want[3][1] == "<b>not bold</b> & <i>x</i>"
        page.wait_for_function(f"document.querySelectorAll('#log .ln').length >= {len(want)}", timeout=15000)
        assert page.evaluate(ROWS) == want
        assert page.locator("#log b").count() == 0
        page.reload()  # the server-rendered page shows what the live one showed
        page.wait_for_function(f"document.querySelectorAll('#log .ln').length >= {len(want)}", timeout=15000)
        assert page.evaluate(ROWS) == want
        c.post(f"/api/runs/{run_id}/stop")
    assert page.dialogs == [] and page.js_errors == []
