"""Login sessions and token checks: revoked on logout and token change, expiry, rate limits, no stalls."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import httpx

from controller.service import Controller
from tests.web.conftest import start_server
from web import security
from web.app import create_app

BASE = "http://127.0.0.1"


async def _login(c: httpx.AsyncClient, token: str) -> str:
    """Log ``c`` in; return the session cookie value it was given."""
    page = await c.get("/login")
    csrf = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page.text)
    assert csrf
    r = await c.post("/login", data={"token": token, "csrf_token": csrf.group(1), "next": "/"})
    assert r.status_code == 303, r.text
    value = c.cookies.get(security.SESSION_COOKIE)
    assert value
    return value


async def _status_with_cookie(app: object, cookie: str, path: str = "/api/runs") -> int:
    """Status of ``path`` for a fresh client that only holds a copy of ``cookie``."""
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as other:
        other.cookies.set(security.SESSION_COOKIE, cookie)
        return (await other.get(path)).status_code


async def test_logout_revokes_the_session_cookie(ctl: Controller) -> None:
    token = security.ensure_token(ctl.settings.home)
    assert token
    app = create_app(ctl, bind="0.0.0.0")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        cookie = await _login(c, token)
        assert await _status_with_cookie(app, cookie) == 200  # a copy works while logged in
        csrf = (await c.get("/api/csrf")).json()["csrf_token"]
        r = await c.post("/logout", data={"csrf_token": csrf})
        assert r.status_code == 303
    assert await _status_with_cookie(app, cookie) == 401  # ... and dies with the logout


async def test_replacing_the_token_voids_old_cookies(ctl: Controller) -> None:
    home = ctl.settings.home
    token = security.ensure_token(home)
    assert token
    app = create_app(ctl, bind="0.0.0.0")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        cookie = await _login(c, token)
    assert await _status_with_cookie(create_app(ctl, bind="0.0.0.0"), cookie) == 200  # a restart keeps it
    (home / security.TOKEN_FILE).unlink()
    assert security.ensure_token(home)  # the token is replaced (a leaked one revoked)
    assert await _status_with_cookie(create_app(ctl, bind="0.0.0.0"), cookie) == 401


async def test_sessions_expire(ctl: Controller) -> None:
    token = security.ensure_token(ctl.settings.home)
    assert token
    ctl.settings.session_ttl_s = 2.0
    app = create_app(ctl, bind="0.0.0.0")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        r0 = await c.get("/login")
        assert "Max-Age=" in r0.headers["set-cookie"]
        cookie = await _login(c, token)
        assert await _status_with_cookie(app, cookie) == 200
        await asyncio.sleep(3.1)  # whole seconds in the cookie: a 2 s TTL is over within 3 s
        assert await _status_with_cookie(app, cookie) == 401


async def test_eleventh_wrong_login_in_a_minute_gets_429(ctl: Controller) -> None:
    token = security.ensure_token(ctl.settings.home)
    assert token
    app = create_app(ctl, bind="0.0.0.0")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        page = await c.get("/login")
        csrf = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page.text)
        assert csrf
        form = {"csrf_token": csrf.group(1), "next": "/"}
        for i in range(10):
            r = await c.post("/login", data={**form, "token": f"wrong-{i % 3}"})
            assert r.status_code == 401, i
        r = await c.post("/login", data={**form, "token": "wrong-again"})
        assert r.status_code == 429 and "too many" in r.text
        r = await c.get("/api/runs", headers={"authorization": "Bearer still-wrong"})
        assert r.status_code == 429 and r.headers["retry-after"] == "60"
        assert (await c.get("/api/health")).status_code == 200  # requests without a token are not limited


def _p95(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[min(len(samples) - 1, int(len(samples) * 0.95))]


FLOOD = """
import asyncio, json, sys
import httpx

async def main(url: str, n: int) -> None:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as c:
        async def bad(i: int) -> int:
            r = await c.get("/api/runs", headers={"authorization": f"Bearer wrong-{i}"})
            return r.status_code
        print("go", flush=True)
        codes = await asyncio.gather(*(bad(i) for i in range(n)))
    print(json.dumps(codes), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_bad_token_flood_does_not_stall_the_server(tmp_path: Path) -> None:
    """120 concurrent requests with wrong bearer tokens (from another process) must not block /api/health:
    the event loop that checks tokens is the one the SSH links share."""
    home = tmp_path / "home"
    home.mkdir()
    assert security.ensure_token(home)
    srv = start_server(home, supervise=False, bind="0.0.0.0")
    flood = None
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:

            async def health() -> float:
                t0 = time.perf_counter()
                r = await c.get("/api/health", timeout=5)
                assert r.status_code == 200
                return time.perf_counter() - t0

            await health()
            baseline = [await health() for _ in range(20)]
            flood = await asyncio.create_subprocess_exec(
                sys.executable, "-c", FLOOD, srv.url, "120", stdout=asyncio.subprocess.PIPE
            )
            assert flood.stdout is not None
            assert (await asyncio.wait_for(flood.stdout.readline(), 30)).strip() == b"go"
            await asyncio.sleep(0.1)  # the flood's connections are in
            done = asyncio.ensure_future(flood.communicate())
            during: list[float] = []
            while len(during) < 20 or (not done.done() and len(during) < 2000):
                during.append(await health())  # sampled for as long as the flood lasts
                await asyncio.sleep(0.01)
            out, _ = await asyncio.wait_for(done, 60)
        codes = json.loads(out.decode().strip().splitlines()[-1])
        assert set(codes) <= {401, 429} and codes.count(429) >= 100, codes
        base95, flood95 = _p95(baseline), _p95(during)
        assert flood95 < 1.0 and flood95 < 20 * max(base95, 0.005), (base95, flood95, len(during))
    finally:
        if flood is not None and flood.returncode is None:
            flood.kill()
            await flood.wait()
        srv.stop()
