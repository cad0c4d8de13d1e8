"""Live streams on a real uvicorn with a real local agent: SSE delivery and Last-Event-ID resume."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import AgentHost, LiveServer, wait_until

JOB = str(Path(__file__).with_name("fake_vllm_job.py"))
pytestmark = pytest.mark.slow


@pytest.fixture
def c(live_server: LiveServer) -> Iterator[httpx.Client]:
    """A client of the live server with a session and its CSRF token as default header."""
    with httpx.Client(base_url=live_server.url, timeout=30) as client:
        client.headers["x-csrf-token"] = client.get("/api/csrf").json()["csrf_token"]
        yield client


def start_job(
    c: httpx.Client, agent: AgentHost, out: Path, *args: str, env: dict[str, str] | None = None
) -> str:
    """Add the local host (once) and start the fake job through POST /api/runs."""
    if c.get("/api/hosts/local").status_code == 404:
        r = c.post("/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent.state_dir)})
        assert r.status_code == 201, r.text
    spec = {"name": "fake", "host": "local", "backend": "command", "output_dir": str(out),
            "command": [sys.executable, JOB, str(out), *args],
            "expect": {"layers": 4, "hidden_size": 64}, "env": env or {}}  # fmt: skip
    r = c.post("/api/runs", json=spec)
    assert r.status_code == 201, r.text
    run_id: str = r.json()["id"]
    return run_id


def read_events(
    c: httpx.Client, url: str, *, headers: dict[str, str] | None = None, stop: Any = None
) -> list[dict]:
    """Read SSE events until ``stop(events)`` is true or an ``end`` event arrives."""
    events: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    with c.stream("GET", url, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line == "":
                if "event" in cur or "data" in cur:
                    cur["data"] = json.loads(cur["data"]) if "data" in cur else None
                    events.append(cur)
                    if cur.get("event") == "end" or (stop and stop(events)):
                        break
                cur = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                cur[key] = value
    return events


def test_sse_live_then_resume_gets_exactly_what_was_missed(
    agent_host: AgentHost, live_server: LiveServer, c: httpx.Client, tmp_path: Path
) -> None:
    run_id = start_job(c, agent_host, tmp_path / "out", "--progress", "6", "--delay", "0.4")
    url = f"/api/runs/{run_id}/events"

    def two_milestones(evs: list[dict]) -> bool:
        return sum(e.get("event") == "milestone" for e in evs) >= 2

    first = read_events(c, url, stop=two_milestones)
    last_id = [e["id"] for e in first if "id" in e][-1]
    wait_until(lambda: c.get(f"/api/runs/{run_id}").json()["state"] == "completed", 60, what="run completes")
    rest = read_events(c, url, headers={"Last-Event-ID": last_id})
    assert rest[-1]["event"] == "end" and rest[-1]["data"]["state"] == "completed"
    full = read_events(c, url)
    ids = lambda evs: [e["id"] for e in evs if "id" in e]  # noqa: E731
    assert ids(first) + ids(rest) == ids(full)  # nothing missed, nothing twice
    assert len(set(ids(full))) == len(ids(full))
    kinds = {e["event"] for e in full}
    assert {"run", "milestone", "log"} <= kinds
    progress = [e["data"] for e in full if e["event"] == "milestone" and e["data"]["kind"] == "progress"]
    assert [p["fields"]["samples_done"] for p in progress] == [8, 16, 24, 32, 40, 48]
    detail = c.get(f"/api/runs/{run_id}").json()
    assert detail["state"] == "completed" and len(detail["milestones"]) >= 10


def test_run_api_masks_secret_env_values_but_the_job_gets_them(
    agent_host: AgentHost, live_server: LiveServer, c: httpx.Client, tmp_path: Path
) -> None:
    env = {"HF_TOKEN": "hf_supersecret", "NOTE": "plain"}
    run_id = start_job(c, agent_host, tmp_path / "out", "--progress", "1", "--delay", "0", env=env)
    wait_until(lambda: c.get(f"/api/runs/{run_id}").json()["state"] == "completed", 60, what="run completes")
    r = c.get(f"/api/runs/{run_id}")
    assert "hf_supersecret" not in r.text
    assert r.json()["spec"]["env"]["NOTE"] == "plain" and "hidden" in r.json()["spec"]["env"]["HF_TOKEN"]
    spec = json.loads((agent_host.state_dir / "runs" / run_id / "spec.json").read_text())
    assert spec["env"]["HF_TOKEN"] == "hf_supersecret"  # masked in the API only, not in what was launched


def test_finite_stream_in_process_for_finished_run(
    agent_host: AgentHost, live_server: LiveServer, c: httpx.Client, tmp_path: Path
) -> None:
    run_id = start_job(c, agent_host, tmp_path / "out", "--progress", "1", "--delay", "0")
    wait_until(lambda: c.get(f"/api/runs/{run_id}").json()["state"] == "completed", 60, what="run completes")
    # The finished run's stream is finite: httpx's in-process transport (which buffers) can read it whole.
    import asyncio

    async def read_in_process() -> str:
        transport = httpx.ASGITransport(app=live_server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as ac:
            r = await ac.get(f"/api/runs/{run_id}/events")
            return r.text

    # The controller belongs to the server's loop; reads only touch SQLite, so a second loop is fine here.
    body = asyncio.run(read_in_process())
    last = body.strip().split("\n\n")[-1]
    assert last.startswith("event: end\n") and json.loads(last.split("data: ", 1)[1]) == {
        "state": "completed"
    }
    assert "event: milestone" in body and "event: end" in body


def test_idle_stream_sends_keepalive_pings_and_events_still_flow(
    live_server: LiveServer, c: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet stream says ``: ping`` every PING_S (the server writes the stream itself, no relay task)."""
    import web.sse

    monkeypatch.setattr(web.sse, "PING_S", 0.2)
    seen: list[str] = []
    added = False
    with c.stream("GET", "/api/events", params={"after": "now"}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        for line in r.iter_lines():
            seen.append(line)
            if line == ": ping" and not added:
                # an event between pings goes out as one: a host added now is on the dashboard's feed
                added = True
                r2 = c.post("/api/hosts", json={"name": "quiet", "ssh": "nobody@127.0.0.1:1"})
                assert r2.status_code == 201, r2.text
            if seen.count(": ping") >= 3 and any(x.startswith("event: host") for x in seen):
                break
    assert seen[0] == ": eaglewatch" and seen[1] == "retry: 1500"
    host = seen.index("event: host")
    assert json.loads(seen[host + 1].removeprefix("data: "))["name"] == "quiet"
