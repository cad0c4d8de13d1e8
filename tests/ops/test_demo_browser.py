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
from tests.web.conftest import browser, screenshot  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:  # noqa: F811
    """A Chromium page in a context of its own."""
    page = browser.new_page()
    try:
        yield page
    finally:
        page.context.close()


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
        time.sleep(0.2)
        page.reload()
    screenshot(page, "demo-second-run")
    body = page.inner_text("body")
    assert "completed" in body and "progress" in body
