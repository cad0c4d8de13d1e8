"""Log paging for the viewer (web/api.py read_log_page) over a real controller store."""

from __future__ import annotations

import sqlite3
from typing import Any

from controller.service import Controller
from tests.helpers.history import seed_runs
from web.api import read_log_page

WIDTH = 37  # every line takes 36 characters and a newline: line i starts at i * WIDTH


def seed(ctl: Controller, n: int) -> list[dict[str, Any]]:
    """A run ``r-00000`` with ``n`` stored log lines (every 100th an error); the lines as rows."""
    db = ctl.settings.database
    [run] = seed_runs(db, 1)
    rows = [
        {
            "offset": i * WIDTH,
            "text": (f"line {i}" + (" ERROR boom" if i % 100 == 0 else "")).ljust(WIDTH - 1),
        }
        for i in range(n)
    ]
    conn = sqlite3.connect(db)
    with conn:
        for start in range(0, n, 500):
            block = rows[start : start + 500]
            end = block[-1]["offset"] + WIDTH
            text = "\n".join(r["text"] for r in block)
            conn.execute(
                "INSERT INTO log_blocks(run_id, offset, end_offset, text) VALUES (?,?,?,?)",
                (run, block[0]["offset"], end, text),
            )
    conn.close()
    return rows


async def page(ctl: Controller, **kw: Any) -> list[dict[str, Any]]:
    args: dict[str, Any] = {"after": -1, "before": None, "limit": 200, "q": None, "errors_only": False}
    return await read_log_page(ctl, "r-00000", **{**args, **kw})


async def test_tail_of_a_long_log(ctl: Controller) -> None:
    rows = seed(ctl, 100_000)
    assert await page(ctl) == rows[-200:]


async def test_page_before_an_offset_and_after_one(ctl: Controller) -> None:
    rows = seed(ctl, 1000)
    assert await page(ctl, before=rows[500]["offset"]) == rows[300:500]
    assert await page(ctl, after=rows[10]["offset"], limit=5) == rows[11:16]
    # unfiltered, with both bounds: the first lines after ``after``, none at or past ``before``
    assert await page(ctl, after=rows[10]["offset"], before=rows[13]["offset"], limit=5) == rows[11:13]


async def test_short_log_whole(ctl: Controller) -> None:
    rows = seed(ctl, 50)
    assert await page(ctl) == rows


async def test_filtered_views_keep_the_last_matches(ctl: Controller) -> None:
    seed(ctl, 1000)
    found = await page(ctl, limit=3, errors_only=True)
    assert [r["text"].strip() for r in found] == [
        "line 700 ERROR boom", "line 800 ERROR boom", "line 900 ERROR boom"
    ]  # fmt: skip
    found = await page(ctl, limit=2, q="line 99")
    assert [r["text"].strip() for r in found] == ["line 998", "line 999"]
    found = await page(ctl, limit=2, q="ERROR", after=0)  # forwards from an offset
    assert [r["text"].strip() for r in found] == ["line 100 ERROR boom", "line 200 ERROR boom"]
