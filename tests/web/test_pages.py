"""Server-rendered pages in-process: render without JS, form validation, templates, escaping, login gate."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from pathlib import Path
from typing import Any

import httpx

from agent.backends import DEFAULT, Backend
from controller.service import Controller
from tests.helpers.broken_run import seed
from tests.web.conftest import csrf_of, settings_for
from web import security
from web.app import create_app
from web.pages import CHART_POINTS, thin

PAYLOAD = "<script>alert(1)</script>"


async def _host(client: httpx.AsyncClient) -> str:
    tok = await csrf_of(client)
    r = await client.post("/api/hosts", json={"name": "h1", "ssh": "h1"}, headers={"x-csrf-token": tok})
    assert r.status_code == 201
    return tok


async def test_pages_render(client: httpx.AsyncClient) -> None:
    await _host(client)
    for path, marker in [("/", "Hosts"), ("/runs/new", "Layer ids"), ("/alerts", "No alerts")]:
        r = await client.get(path)
        assert r.status_code == 200 and marker in r.text, path
        assert re.search(r'<meta name="csrf-token" content="[0-9a-f]{40}">', r.text)
    dash = (await client.get("/")).text
    assert 'data-host="h1"' in dash and "unknown" in dash
    new = (await client.get("/runs/new")).text
    assert "EAGLE-3 default" in new and "[2, N//2, N-3, N]" in new
    # one option per backend of agent/backends.py, the spec's default selected
    select = re.search(r'<select id="f-backend".*?</select>', new, re.S)
    assert select and re.findall(r'<option value="([a-z-]+)"', select[0]) == [b.value for b in Backend]
    assert f'<option value="{DEFAULT}" selected>' in select[0]
    r = await client.get("/runs/nope")
    assert r.status_code == 404 and "no run" in r.text and "<html" in r.text


async def test_invalid_form_shows_errors_next_to_fields_and_launches_nothing(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    tok = await _host(client)
    form = {"csrf_token": tok, "action": "launch", "name": "ok", "host": "h1", "backend": "worker-extension",
            "model": "relative/model" + PAYLOAD, "dataset": "/d.jsonl", "output_dir": "/out",
            "layers": "2, x",
            "tensor_parallel_size": "0"}  # fmt: skip
    r = await client.post("/runs/new", data=form)
    assert r.status_code == 422
    html = r.text
    assert 'id="err-layers"' in html and "whole numbers" in html
    assert "Nothing was launched" in html
    assert PAYLOAD not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # value kept, escaped
    form["layers"] = "2, 3"
    html = (await client.post("/runs/new", data=form)).text
    assert 'id="err-model"' in html and "absolute path" in html
    assert 'id="err-tensor_parallel_size"' in html
    assert await ctl.list_runs() == []


async def test_unknown_host_error_lands_on_host_field(client: httpx.AsyncClient, ctl: Controller) -> None:
    tok = await csrf_of(client)
    form = {"csrf_token": tok, "action": "launch", "host": "ghost", "backend": "command", "command": "true"}
    r = await client.post("/runs/new", data=form)
    assert r.status_code == 422
    assert 'id="err-host"' in r.text and "ghost" in r.text
    assert await ctl.list_runs() == []


async def test_templates_saved_and_reused(client: httpx.AsyncClient, ctl: Controller) -> None:
    tok = await _host(client)
    form = {"csrf_token": tok, "action": "save_template", "template_name": "dsv3 tp8", "host": "h1",
            "backend": "vllm-native", "model": "/models/dsv3", "layers": "2, 30, 58, 61",
            "tensor_parallel_size": "8"}  # fmt: skip
    r = await client.post("/runs/new", data=form)
    assert r.status_code == 200 and "saved" in r.text
    assert (ctl.settings.home / "run-templates.json").exists()
    html = (await client.get("/runs/new", params={"template": "dsv3 tp8"})).text
    assert 'value="/models/dsv3"' in html and 'value="2, 30, 58, 61"' in html and 'value="8"' in html
    assert "csrf" not in (ctl.settings.home / "run-templates.json").read_text()
    bad = await client.post("/runs/new", data={**form, "template_name": "../x"})
    assert bad.status_code == 422 and "template name" in bad.text
    assert await ctl.list_runs() == []


async def test_login_required_off_loopback(ctl: Controller) -> None:
    token = security.ensure_token(ctl.settings.home)
    assert token
    app = create_app(ctl, bind="0.0.0.0")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        r = await c.get("/")
        assert r.status_code == 303 and r.headers["location"].startswith("/login")
        for path in ("/api/runs", "/metrics"):
            r = await c.get(path)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", path
        assert (await c.get("/api/health")).status_code == 200
        page = await c.get("/login")
        csrf = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page.text)
        assert csrf
        r = await c.post("/login", data={"token": "wrong", "csrf_token": csrf.group(1), "next": "/"})
        assert r.status_code == 401 and "wrong token" in r.text
        r = await c.post("/login", data={"token": token, "csrf_token": "nope", "next": "/"})
        assert r.status_code == 403
        r = await c.post(
            "/login", data={"token": token, "csrf_token": csrf.group(1), "next": "//evil.example"}
        )
        assert r.status_code == 303 and r.headers["location"] == "/"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert (await c.get("/api/runs")).status_code == 200
        assert token not in (await c.get("/")).text
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        r = await c.get("/api/runs", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200
        r = await c.post(
            "/api/hosts", json={"name": "b", "ssh": "b"}, headers={"authorization": f"Bearer {token}"}
        )
        assert r.status_code == 201  # a bearer token is not sent by browsers on their own: no CSRF needed
        assert (await c.get("/api/runs", headers={"authorization": "Bearer nope"})).status_code == 401


async def test_secrets_never_rendered(ctl: Controller) -> None:
    from pydantic import SecretStr

    ctl.settings.apprise_urls = [SecretStr("slack://T000/B000/supersecretwebhook")]
    app = create_app(ctl)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        for path in ("/", "/alerts", "/runs/new", "/api/hosts", "/openapi.json", "/metrics"):
            assert "supersecretwebhook" not in (await c.get(path)).text


def _long_run(home: Path, samples: int) -> None:
    """A run whose journal holds ``samples`` progress milestones (a night's worth), each with layer RMS."""
    events: list[dict[str, Any]] = [{"type": "state", "state": "running"}]
    for i in range(samples):
        fields = {
            "samples_done": i,
            "samples_total": samples,
            "tokens_per_s": 1000.0 + i,
            "layer_rms": {"2": 0.5},
        }
        events.append(
            {
                "type": "milestone",
                "kind": "progress",
                "line": i + 1,
                "rank": None,
                "fields": fields,
                "text": "p",
            }
        )
    seed(home / "eaglewatch.db", "/scratch/long", run_id="r-long", events=[
        {"seq": n, "ts": 1000.0 + n, **ev} for n, ev in enumerate(events, 1)
    ])  # fmt: skip


async def test_run_page_charts_carry_a_thinned_series_of_a_long_runs_samples(tmp_path: Path) -> None:
    """5,000 progress samples: the page's chart data holds CHART_POINTS of them, evenly spread, the first and
    the last included, for the progress chart and the layer chart alike; the timeline still counts all."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    await asyncio.to_thread(_long_run, home, 5000)
    ctl = Controller(settings_for(home), supervise=False)
    await ctl.start()
    try:
        transport = httpx.ASGITransport(app=create_app(ctl))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            html = (await client.get("/runs/r-long")).text
    finally:
        await ctl.stop()
    found = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S)
    assert found is not None
    data = json.loads(found.group(1))
    done = [p["samples_done"] for p in data["progress"]]
    assert len(done) == CHART_POINTS and done[0] == 0 and done[-1] == 4999
    gaps = {b - a for a, b in itertools.pairwise(done)}
    assert gaps <= {5, 6}  # evenly spread: 4999 / 999 ≈ 5.004
    assert len(data["layer_rms"]) == CHART_POINTS and data["milestone_count"] == 5000
    assert len(html) < 400_000  # 5,000 samples in full weigh about 1 MB


def test_thin_keeps_short_series_whole_and_ends_of_long_ones() -> None:
    assert thin([1, 2, 3], limit=5) == [1, 2, 3]
    assert thin(list(range(10)), limit=4) == [0, 3, 6, 9]
    assert thin(list(range(11)), limit=2) == [0, 10]
