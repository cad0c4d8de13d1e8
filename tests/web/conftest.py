"""Web test fixtures: a real Controller on a tmp home, the app in-process, a real uvicorn, a local agent."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from controller.service import Controller
from controller.settings import Settings
from tests.helpers.agentproc import cleanup_runs
from tests.helpers.sshd import kill_tree_matching
from web.app import create_app


def settings_for(home: Path) -> Settings:
    """Settings on a tmp home with fast reconnects (no user config read)."""
    return Settings(home=home, reconnect_initial_s=0.1, reconnect_max_s=1.0, stall_min_s=3600)


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[Controller]:
    """A started Controller (no supervisors: nothing to connect to) on a tmp SQLite file."""
    c = Controller(settings_for(tmp_path / "home"), supervise=False)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


@pytest.fixture
async def client(ctl: Controller) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process (httpx ASGI transport; buffers bodies, so never for live SSE)."""
    app = create_app(ctl)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        yield c


async def csrf_of(client: httpx.AsyncClient) -> str:
    """This client's CSRF token (its cookie jar holds the session)."""
    r = await client.get("/api/csrf")
    token: str = r.json()["csrf_token"]
    return token


@dataclass
class AgentHost:
    """A local agent state dir (daemon started on demand by ``python -m agent connect``)."""

    state_dir: Path

    def cleanup(self) -> None:
        """Kill every job, then the daemon (pid in daemon.lock, its own session), and any process still
        naming the state dir: a daemon that was starting has no lock file yet."""
        cleanup_runs(self.state_dir)
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.state_dir / "daemon.lock").read_text().split()[0])
            os.killpg(pid, signal.SIGKILL)
        kill_tree_matching(str(self.state_dir) + "/")
        shutil.rmtree(self.state_dir, ignore_errors=True)


@pytest.fixture
def agent_host() -> Iterator[AgentHost]:
    """A short state dir (Unix socket paths are limited to 108 bytes); teardown kills daemon and jobs."""
    host = AgentHost(Path(tempfile.mkdtemp(prefix="ewa", dir="/tmp")))
    try:
        yield host
    finally:
        host.cleanup()


@dataclass
class LiveServer:
    """A real uvicorn serving the app (and its own Controller) on 127.0.0.1:<ephemeral>."""

    url: str
    home: Path
    server: uvicorn.Server
    thread: threading.Thread
    app: Any

    def stop(self) -> None:
        """Graceful stop, forced after a short wait."""
        self.server.should_exit = True
        self.thread.join(15)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(5)


def start_server(
    home: Path, *, supervise: bool = True, settings: Settings | None = None, **app_kwargs: Any
) -> LiveServer:
    """Start uvicorn in a thread (its own event loop runs the app's lifespan: controller start/stop)."""
    ctl = Controller(settings or settings_for(home), supervise=supervise)
    app = create_app(ctl, manage_controller=True, **app_kwargs)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", ws="none", lifespan="on",
        timeout_graceful_shutdown=2,
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(f"http://127.0.0.1:{port}", home, server, thread, app)


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[LiveServer]:
    """Real uvicorn + real Controller (supervising) on a tmp home."""
    srv = start_server(tmp_path / "home")
    try:
        yield srv
    finally:
        srv.stop()


def wait_until(pred: Any, timeout: float = 30.0, interval: float = 0.1, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


CHROMIUM = "/usr/bin/chromium"  # Debian's
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
SHOTS = Path(__file__).resolve().parents[2] / "test-output"


@pytest.fixture
def browser() -> Iterator[Any]:
    """Debian's headless Chromium driven by Playwright (Playwright's own browser download is not used)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def screenshot(page: Any, name: str) -> Path:
    """Save a full-page screenshot under test-output/ (gitignored) for a human to look at."""
    SHOTS.mkdir(exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
