"""History pages in-process over a real Controller and SQLite file: API and dashboard paging through 10,000
runs, and the run page of a run with 1,000,000 stored lines (it renders one page of its log, not all)."""

from __future__ import annotations

import re

import httpx

from controller.service import Controller
from tests.helpers.history import seed_log, seed_runs
from web.pages import DASHBOARD_RUNS, LOG_PAGE


async def test_api_pages_through_runs(ctl: Controller, client: httpx.AsyncClient) -> None:
    ids = seed_runs(ctl.settings.database, 10_000)[::-1]
    r = await client.get("/api/runs")
    assert r.status_code == 200 and r.headers["x-total-count"] == "10000"
    assert [x["id"] for x in r.json()] == ids[:100]
    r = await client.get("/api/runs", params={"limit": 1000, "offset": 9500})
    assert [x["id"] for x in r.json()] == ids[9500:]
    r = await client.get("/api/runs", params={"limit": 1001})
    assert r.status_code == 422 and "limit" in r.text
    assert (await client.get("/api/runs", params={"offset": -1})).status_code == 422
    assert (await client.get("/api/runs", params={"offset": 2**63})).status_code == 422  # beyond SQLite's int


async def test_dashboard_pages_through_runs(ctl: Controller, client: httpx.AsyncClient) -> None:
    ids = seed_runs(ctl.settings.database, 10_000)[::-1]
    pages = 10_000 // DASHBOARD_RUNS
    first = (await client.get("/")).text
    assert re.findall(r'data-run="([^"]+)"', first) == ids[:DASHBOARD_RUNS]
    assert f"page 1 of {pages}" in first and 'href="/?page=2"' in first and "newer" not in first
    last = (await client.get("/", params={"page": pages})).text
    assert re.findall(r'data-run="([^"]+)"', last) == ids[-DASHBOARD_RUNS:]
    assert f'href="/?page={pages - 1}"' in last and "older" not in last
    assert (await client.get("/", params={"page": 0})).status_code == 422


async def test_run_page_with_a_million_lines_shows_one_page(
    ctl: Controller, client: httpx.AsyncClient
) -> None:
    (rid,) = seed_runs(ctl.settings.database, 1)
    seed_log(ctl.settings.database, rid, 1_000_000, width=40)
    html = (await client.get(f"/runs/{rid}")).text
    shown = re.findall(r"line (\d{9}) ", html)
    assert len(shown) == LOG_PAGE and shown[-1] == "000999999"  # the tail, one page of it
    # the rest streams on demand: the page before the tail, through the log API
    first = int(shown[0]) * 40
    r = await client.get(f"/api/runs/{rid}/log", params={"before": first, "limit": 500})
    assert r.status_code == 200, r.text
    older = r.json()
    assert len(older) == 500 and older[-1]["text"].startswith(f"line {int(shown[0]) - 1:09d}")
