"""`eaglewatch demo` end to end: a real demo process (uvicorn, SQLite, a local agent daemon, real jobs).

The fast test runs the demo with --no-extract (a backend-command job printing milestone lines instead of
vLLM); the vllm-marked test runs the real CPU extraction, then a broken run that must raise an alert.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.demo import daemons_of
from tests.extract.jobrun import IN_PROCESS_ENGINE
from tests.helpers.agentproc import cleanup_runs
from tests.web.conftest import browser  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Demo:
    """A running demo process, its URL and token, and everything it printed so far."""

    proc: subprocess.Popen[str]
    home: Path
    url: str = ""
    token: str = ""
    first_run: str = ""
    lines: list[str] = field(default_factory=list)

    def client(self, auth: bool = True) -> httpx.Client:
        """An HTTP client for the demo's web UI."""
        headers = {"Authorization": f"Bearer {self.token}"} if auth else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def output(self) -> str:
        """What the demo printed."""
        return "".join(self.lines)


def _reader(demo: Demo) -> None:
    assert demo.proc.stdout is not None
    for line in demo.proc.stdout:
        demo.lines.append(line)


def daemon_pid(home: Path) -> int | None:
    """The demo agent daemon's pid from its lock file, if it is alive."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((home / "agent" / "daemon.lock").read_text().split()[0])
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            return pid
    return None


def start_demo(
    home: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> Iterator[Demo]:
    """Start `eaglewatch demo --home HOME --port 0 ARGS` (the README's command, as `python -m cli`);
    wait for its URL, token and first run."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "demo", "--home", str(home), "--port", "0", *args],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
    )  # fmt: skip
    demo = Demo(proc, home)
    reader = threading.Thread(target=_reader, args=(demo,), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            out = demo.output()
            url, token, run = (
                re.search(p, out) for p in (r"URL:\s+(\S+)", r"token:\s+(\S+)", r"runs/(\S+)\n")
            )
            if url and token and run:
                demo.url, demo.token, demo.first_run = url[1], token[1], run[1]
                break
            time.sleep(0.1)
        assert demo.first_run, f"demo did not start:\n{demo.output()}"
        yield demo
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()
        # Agent daemons run in their own sessions: make sure nothing of the demo is left behind.
        for pid in daemons_of(home / "agent"):
            os.kill(pid, signal.SIGKILL)
        cleanup_runs(home / "agent")


@pytest.fixture
def command_demo(tmp_path: Path) -> Iterator[Demo]:
    """The demo with a command job instead of vLLM."""
    yield from start_demo(tmp_path / "demo", "--no-extract", timeout=90)


def wait_run(demo: Demo, run: str, pred: Any, timeout: float) -> dict[str, Any]:
    """Poll GET /api/runs/{run} until pred(detail) holds."""
    deadline = time.monotonic() + timeout
    detail: dict[str, Any] = {}
    with demo.client() as http:
        while time.monotonic() < deadline:
            detail = http.get(f"/api/runs/{run}").json()
            if pred(detail):
                return detail
            time.sleep(0.2)
    raise AssertionError(f"run {run} never got there: {detail}\n--- demo output:\n{demo.output()}")


def kinds(detail: dict[str, Any]) -> list[str]:
    """Milestone kinds of a run detail."""
    return [m["kind"] for m in detail.get("milestones", [])]


@pytest.mark.slow
def test_demo_serves_and_a_run_reaches_milestones(command_demo: Demo) -> None:
    demo = command_demo
    assert demo.url.startswith("http://127.0.0.1:")
    with demo.client(auth=False) as anonymous:
        health = anonymous.get("/api/health")
        assert health.status_code == 200 and health.json()["ok"] is True
        assert anonymous.get("/api/runs").status_code == 401  # the printed token is needed
    detail = wait_run(demo, demo.first_run, lambda d: d.get("state") == "completed", 60)
    assert "progress" in kinds(detail) and "completed" in kinds(detail)
    assert detail["spec"]["host"] == "local"
    with demo.client() as http:
        hosts = http.get("/api/hosts").json()
        assert [h["name"] for h in (hosts if isinstance(hosts, list) else hosts["hosts"])] == ["local"]
    assert "batch 1 captured: 2 files" in demo.output()  # milestones are echoed on the terminal too, in words


def wait_printed(demo: Demo, pattern: str, timeout: float = 60) -> re.Match[str]:
    """Wait until the demo has printed a line matching ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := re.search(pattern, demo.output(), re.M):
            return found
        time.sleep(0.1)
    raise AssertionError(f"the demo never printed {pattern!r}:\n{demo.output()}")


@pytest.mark.slow
def test_one_demo_per_home_and_its_line_points_the_cli_at_it(command_demo: Demo) -> None:
    """A second real demo on the same home refuses, naming the first one's URL, and changes nothing; the
    printed export line makes `eaglewatch runs ls` see the demo's runs."""
    demo = command_demo
    second = subprocess.run(
        [sys.executable, "-m", "cli", "demo", "--home", str(demo.home), "--port", "0", "--no-extract"],
        cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"another eaglewatch demo runs on {demo.home} at {demo.url}" in second.stderr
    with demo.client() as http:  # the first demo's token still works: the second one touched nothing
        assert http.get("/api/runs").status_code == 200
    export = wait_printed(demo, r"^\s+CLI:\s+export (EAGLEWATCH_HOME=\S+)")
    name, _, value = shlex.split(export[1])[0].partition("=")
    env = {k: v for k, v in os.environ.items() if k != "EAGLEWATCH_HOME"}
    listed = subprocess.run(
        [sys.executable, "-m", "cli", "runs", "ls", "--json", "--no-refresh"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**env, name: value},
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert demo.first_run in [r["id"] for r in json.loads(listed.stdout)]
    # the terminal: one line per batch, the verdict once, no file's check on a line of its own
    wait_printed(demo, rf"run {demo.first_run}: verdict: completed")
    mine = [ln for ln in demo.output().splitlines() if f"run {demo.first_run}:" in ln]
    assert sum("captured: 2 files, 64 tokens, 2 passed shape checks" in ln for ln in mine) == 3, mine
    assert sum("verdict:" in ln for ln in mine) == 1 and not any("shape check passed" in ln for ln in mine)


@pytest.mark.slow
def test_demo_starts_another_run_from_the_api_and_stops_everything(command_demo: Demo) -> None:
    demo = command_demo
    job = 'import time\nprint(\'EAGLEWATCH {"kind": "progress"}\', flush=True)\ntime.sleep(120)'
    spec = {"name": "second", "host": "local", "backend": "command", "command": [sys.executable, "-c", job]}
    with demo.client() as http:
        created = http.post("/api/runs", json=spec, headers={"Origin": demo.url.rstrip("/")})
        assert created.status_code == 201, created.text
        run = created.json()["id"]
    wait_run(demo, run, lambda d: d.get("state") == "running" and "progress" in kinds(d), 60)
    daemon = daemon_pid(demo.home)
    assert daemon is not None
    demo.proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert demo.proc.wait(60) == 0
    assert f"stopped run {run}" in demo.output()
    assert daemons_of(demo.home / "agent") == [], "the demo left an agent daemon running"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_demo_real_extraction_and_broken_run_alert(tmp_path: Path, browser: Any) -> None:  # noqa: F811
    """The real thing: tiny model, vLLM on CPU, shape checks pass; the page's saved "broken" template, as
    the New-run form turns it into a spec, drops a layer: its shape checks fail and raise an alert. Chromium
    watches each run's page from launch to end without a reload; it ends as the page loaded afresh."""
    from tests.web.test_run_page_live import live_equals_reload
    from web.forms import check_form
    from web.run_templates import TemplateStore

    # the demo's runs, not vLLM's process layout, are the subject (tests/extract/jobrun.IN_PROCESS_ENGINE)
    for demo in start_demo(tmp_path / "demo", timeout=600, env=IN_PROCESS_ENGINE):
        ctx = browser.new_context(base_url=demo.url, viewport={"width": 1280, "height": 900})
        js_errors: list[str] = []
        ctx.on("page", lambda p: p.on("pageerror", lambda e: js_errors.append(str(e))))  # noqa: B023
        login = ctx.new_page()
        login.goto("/login")
        login.fill("#token", demo.token)
        login.get_by_role("button", name="Log in").click()
        login.wait_for_load_state()
        live = ctx.new_page()
        live.goto(f"/runs/{demo.first_run}")  # right after launch: the engine is still starting
        live.evaluate("window.__noReload = 1")
        good = live_equals_reload(live, demo.first_run, 600)
        assert "completed" in good[0] and "files ok" in good[0], good[0]
        assert "points=0" not in " ".join(good)  # the per-layer chart drew points
        detail = wait_run(demo, demo.first_run, lambda d: d.get("state") in ("completed", "failed"), 60)
        assert detail["state"] == "completed", detail
        assert "error" not in kinds(detail)  # vLLM's engine exit after completion is a normal_shutdown
        assert {"capture_configured", "shape_check_passed", "completed"} <= set(kinds(detail))
        assert "shape_check_failed" not in kinds(detail)
        form = TemplateStore(demo.home).get("demo broken - drops a layer") or {}
        spec, errors = check_form({**form, "output_dir": str(tmp_path / "demo" / "outputs" / "tpl")})
        assert errors == {} and spec is not None
        origin = {"Origin": demo.url.rstrip("/")}
        with demo.client() as http:
            created = http.post("/api/runs", json=spec.model_dump(mode="json"), headers=origin)
            assert created.status_code == 201, created.text
            run = created.json()["id"]
        live = ctx.new_page()
        live.goto(f"/runs/{run}")
        live.evaluate("window.__noReload = 1")

        def alerted(d: dict[str, Any]) -> bool:
            return bool(d.get("alerts")) and "shape_check_failed" in kinds(d)

        detail = wait_run(demo, run, alerted, 600)
        failed = [m["fields"] for m in detail["milestones"] if m["kind"] == "shape_check_failed"]
        assert any(f.get("code") == "layer_count_mismatch" for f in failed), failed  # the dropped layer
        assert "shape_check_failed" in {a["rule"] for a in detail["alerts"]}, detail["alerts"]
        assert "layer" in str(detail["alerts"]).lower()
        with demo.client() as http:
            stop = http.post(f"/api/runs/{run}/stop", headers=origin)
            assert stop.status_code == 200, stop.text
        broken = live_equals_reload(live, run, 120)
        checks = next(w for w in broken if w.startswith("#checks-card"))
        assert "layer count mismatch" in checks and "[T, 3, 128]" in checks, checks  # the dropped layer
        ctx.close()
        assert js_errors == [], js_errors


def test_demo_templates_fill_the_new_run_form(tmp_path: Path) -> None:
    """The saved templates turn back into valid specs through the New-run form's own conversion."""
    from cli import demo as demo_mod
    from web.forms import check_form
    from web.run_templates import TemplateStore

    paths = demo_mod.DemoPaths(tmp_path)
    demo_mod.save_templates(tmp_path, paths, extract=True)
    store = TemplateStore(tmp_path)
    assert store.names() == ["demo broken - drops a layer", "demo tiny llama"]
    good, errors = check_form(store.get("demo tiny llama") or {})
    assert errors == {} and good is not None
    assert good.backend == "worker-extension" and good.model == str(paths.model)
    assert good.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert re.fullmatch(rf"{paths.home}/outputs/demo-2-\d{{8}}-\d{{6}}", good.output_dir or "")  # a fresh one
    bad, errors = check_form(store.get("demo broken - drops a layer") or {})
    assert errors == {} and bad is not None and bad.inject_fault == "drop_layer"


def test_demo_dataset_uses_the_tiny_vocabulary(tmp_path: Path) -> None:
    from agent.extract.tinymodel import SPECIALS, VOCAB_WORDS
    from cli.demo import write_dataset

    path = tmp_path / "d.jsonl"
    write_dataset(path, samples=24)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 24
    words = {w for r in rows for w in r["text"].split()}
    assert all(w.startswith("w") and int(w[1:]) < VOCAB_WORDS - len(SPECIALS) for w in words)
