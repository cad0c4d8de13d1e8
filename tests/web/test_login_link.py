"""One-time login links and the login page's reason, against the app in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from controller.service import Controller
from tests.web.conftest import settings_for
from web import security
from web.app import create_app

BASE = "http://127.0.0.1"


@pytest.fixture
async def auth_ctl(tmp_path: Path) -> AsyncIterator[Controller]:
    """A started Controller whose home holds a login token."""
    c = Controller(settings_for(tmp_path / "home"), supervise=False)
    await c.start()
    security.ensure_token(tmp_path / "home")
    try:
        yield c
    finally:
        await c.stop()


def _client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)  # type: ignore[arg-type]


async def test_a_login_link_works_once_then_never(auth_ctl: Controller) -> None:
    app = create_app(auth_ctl, require_auth=True)
    code = app.state.login_links.issue()
    async with _client(app) as c:
        assert (await c.get("/api/runs")).status_code == 401
        r = await c.get(f"/login/link?code={code}")
        assert r.status_code == 303 and r.headers["location"] == "/"  # a clean URL, the code left behind
        assert "httponly" in r.headers["set-cookie"].lower()
        assert (await c.get("/api/runs")).status_code == 200
    async with _client(app) as other:
        used = await other.get(f"/login/link?code={code}")
        assert used.status_code == 401 and "already used or has expired" in used.text
        assert (await other.get("/api/runs")).status_code == 401
        assert (await other.get("/login/link?code=made-up")).status_code == 401
        app.state.login_links.ttl_s = 0.0
        stale = app.state.login_links.issue()
        assert (await other.get(f"/login/link?code={stale}")).status_code == 401
        assert (await other.get("/api/runs")).status_code == 401


@pytest.mark.parametrize(
    ("bind", "said", "not_said"),
    [
        ("127.0.0.1", "listens on 127.0.0.1 only, but every account on this machine", "beyond this machine"),
        ("0.0.0.0", "listens on 0.0.0.0, beyond this machine", "only"),
    ],
)
async def test_the_login_page_says_why_it_asks(
    auth_ctl: Controller, bind: str, said: str, not_said: str
) -> None:
    app = create_app(auth_ctl, bind=bind, require_auth=True)
    async with _client(app) as c:
        page = (await c.get("/login")).text
    assert said in page and not_said not in page.split('id="login-reason">')[1].split("</p>")[0]
