"""The newcomer's path through the demo in Debian's headless Chromium: log in with the printed token, start
another run from a saved template on the New-run page, watch it reach its milestones."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ops.test_demo import Demo, start_demo

CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
SHOTS = Path(__file__).resolve().parents[2] / "test-output"

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture
def page() -> Iterator[Any]:
    """A Chromium page (Debian's /usr/bin/chromium through Playwright)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            yield browser.new_page()
        finally:
            browser.close()


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    """The demo with a command job instead of vLLM."""
    yield from start_demo(tmp_path / "demo", "--no-extract", timeout=90)


def test_login_and_start_a_run_from_a_template(demo: Demo, page: Any) -> None:
    page.goto(demo.url)
    assert "/login" in page.url  # the demo asks for its token
    page.fill("#token", demo.token)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_load_state()
    assert "/login" not in page.url
    page.goto(demo.url + "runs/new?template=demo command job")
    assert page.input_value("#f-backend") == "command"
    page.get_by_role("button", name="Launch run").click()
    page.wait_for_url(re.compile(r".*/runs/r-[^/]+$"))
    run = page.url.rsplit("/", 1)[1]
    assert run != demo.first_run
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "completed" not in page.inner_text("body"):
        time.sleep(1)
        page.reload()
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "demo-second-run.png"), full_page=True)
    body = page.inner_text("body")
    assert "completed" in body and "progress" in body
