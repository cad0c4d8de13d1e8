"""The Hosts page in Debian's headless Chromium: real uvicorn, real Controller, a real local agent.

One host is the local agent (reachable, its version shown); the other is added through the form with an
address that resolves nowhere, then removed from the page.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import agent
from tests.web.conftest import AgentHost, LiveServer, screenshot, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_add_see_and_remove_a_host(agent_host: AgentHost, live_server: LiveServer, browser: Any) -> None:
    with httpx.Client(base_url=live_server.url) as c:
        c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
        body = {"name": "local", "ssh": "local", "state_dir": str(agent_host.state_dir)}
        assert c.post("/api/hosts", json=body).status_code == 201
        wait_until(lambda: c.get("/api/hosts/local").json()["reachable"], 30, what="agent reachable")
    ctx = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto("/")
        page.click("nav a[href='/hosts']")
        page.wait_for_url("**/hosts")
        local = page.locator("[data-host=local]")
        assert local.locator("[data-field=reachable]").inner_text() == "reachable"
        assert local.locator("[data-field=agent_version]").inner_text() == agent.__version__
        assert local.locator("[data-field=scheduler]").inner_text().startswith("ssh")

        page.click("text=Add host")
        page.fill("#f-name", "gpu9")
        page.fill("#f-ssh", "gpu9.invalid")
        page.click("button[type=submit]")
        page.wait_for_url("**/hosts")
        assert page.locator("[data-host=gpu9]").count() == 1
        screenshot(page, "hosts-page")

        page.locator("[data-host=gpu9] button[data-action=remove]").click()
        page.wait_for_url("**/hosts")
        assert page.locator("[data-host=gpu9]").count() == 0
        assert page.locator("[data-host=local]").count() == 1
        assert errors == []
    finally:
        ctx.close()
    with httpx.Client(base_url=live_server.url) as c:
        assert [h["name"] for h in c.get("/api/hosts").json()] == ["local"]
