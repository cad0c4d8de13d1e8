"""A newcomer's first minute with the demo, in headless Chromium: the printed link logs in by itself (once),
the login page says truly why it asks, no false "offline" badge, and the terminal speaks in words."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ops.test_demo import Demo, start_demo, wait_run
from tests.ops.test_demo_browser import browser, page  # noqa: F401 (the fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    """The demo with a command job instead of vLLM."""
    yield from start_demo(tmp_path / "demo", "--no-extract", timeout=90)


def test_printed_link_logs_in_once_and_the_terminal_speaks_words(demo: Demo, page: Any) -> None:  # noqa: F811
    found = re.search(r"open:\s+(\S+)", demo.output())
    assert found, demo.output()
    link = found[1]
    assert link.startswith(demo.url + "login/link?code=")

    page.goto(link)
    assert page.url == demo.url  # logged in, and the code is gone from the address bar
    page.wait_for_selector("#live-status[data-state=live]")  # the dashboard is live and says so
    page.goto(demo.url + "runs/new")  # no live updates on this page: no badge claiming "offline"
    assert not page.locator("#live-status").is_visible()
    assert "offline" not in page.inner_text("header")

    other = page.context.browser.new_context()
    try:
        again = other.new_page()
        response = again.goto(link)  # single use
        assert response.status == 401 and "already used" in again.inner_text("main")
        reason = again.locator("#login-reason").inner_text()
        assert "127.0.0.1" in reason and "beyond this machine" not in reason
        assert "every account on this machine" in reason
        again.goto(demo.url + "runs/new")
        assert "/login" in again.url  # still not logged in there
    finally:
        other.close()

    wait_run(demo, demo.first_run, lambda d: d.get("state") == "completed", 60)

    def echoed_lines() -> list[str]:
        return [ln for ln in demo.output().splitlines() if ln.strip().startswith(f"run {demo.first_run}:")]

    deadline = time.monotonic() + 30  # the terminal echo follows the stored milestone
    while not any("completed:" in ln for ln in echoed_lines()) and time.monotonic() < deadline:
        time.sleep(0.05)
    echoed = echoed_lines()
    text = "\n".join(echoed)
    assert '{"' not in text and "EAGLEWATCH" not in text, text
    assert "shape check passed" not in text  # folded into the batch lines
    batches = [ln for ln in echoed if "captured" in ln]
    assert len(batches) == 3, text  # one line per batch of two
    assert "batch 1 captured: 2 files, 64 tokens, 2 passed shape checks; 2/6 samples" in batches[0]
    assert any("completed: 6 samples" in ln for ln in echoed), text
