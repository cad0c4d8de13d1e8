"""UI benchmark: log line appended → milestone visible in Chromium's DOM; weight/render of a heavy run page.

    .venv/bin/python tests/bench/bench_ui_latency.py [--milestones 200] [--lines 100000]
        [--heavy-milestones 1000]

Everything is real: uvicorn on loopback, the Controller, an agent daemon, the job (a stand-in for vLLM
that prints a progress marker line each time the benchmark bumps a counter file), and Chromium.  The
latency is measured twice: with the agent reached over local pipes, and through the real SSH link (a
loopback OpenSSH sshd, the agent uploaded and started by the controller's bootstrap, as on a GPU host).
Latency = DOM insertion time (the ew:milestone event, page clock) − the moment the job wrote the line (its
``t_line_ms`` field; same machine clock).  The controller runs in a process of its own, as ``eaglewatch
serve`` does (serve_apart.py).  The goal is the SSH figure: p99 <= 50 ms at ten milestones a second.
The job waits for each line on a named pipe the benchmark writes to (no polling); the time from that
wake-up to the DOM is printed too ("from wake-up").
Pacing: the next line is written ``--gap-ms`` (100) after the last milestone reached the DOM: ten
milestones a second, more than an extraction logs (vLLM's stats line comes every 10 s, a progress marker once
a batch).  Through SSH the run is also timed back to back (``--gap-ms 0``: the next line as soon as the last
milestone is in the DOM, while the page still lays out and paints it and takes in its log line): a stress
figure, printed and reported apart (``ssh line_to_dom_p99 back-to-back``), with no goal.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from tests.bench.run_all import SKIP_EXIT, bench_line  # noqa: E402
from tests.bench.serve_apart import ApartServer  # noqa: E402
from tests.helpers.sshd import SSHD, SSHD_BIN, kill_tree_matching  # noqa: E402
from tests.web.conftest import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    AgentHost,
    settings_for,
    wait_until,
)

JOB = str(ROOT / "tests" / "web" / "fake_vllm_job.py")
#: The page appends a live milestone's row to the timeline, then dispatches ``ew:milestone``
#: (web/static/app.js): the time of that event is the row's DOM insertion, whatever part of the page was
#: swapped for a newer render meanwhile (which adds again the rows newer than that render: counted once).
OBSERVER = """() => {
  window.__seen = []; const seqs = new Set();
  document.addEventListener('ew:milestone', (e) => {
    if (e.detail.kind !== 'progress' || seqs.has(e.detail.seq)) return;
    seqs.add(e.detail.seq);
    window.__seen.push(performance.timeOrigin + performance.now());
  });
}"""


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def start_run(c: httpx.Client, agent: AgentHost, out: Path, *args: str, ssh: str = "local") -> str:
    """Start the stand-in job through the API on host ``local`` (pipes) or ``remote`` (``ssh`` alias)."""
    host = "local" if ssh == "local" else "remote"
    if c.get(f"/api/hosts/{host}").status_code == 404:
        body = {"name": host, "ssh": ssh, "state_dir": str(agent.state_dir)}
        if host == "remote":
            body["python"] = sys.executable
        c.post("/api/hosts", json=body).raise_for_status()
        wait_until(lambda: c.get(f"/api/hosts/{host}").json()["reachable"], 60, what="agent reachable")
    spec = {
        "name": "bench",
        "host": host,
        "backend": "command",
        "command": [sys.executable, JOB, str(out), *args],
    }
    r = c.post("/api/runs", json=spec)
    r.raise_for_status()
    run_id: str = r.json()["id"]
    return run_id


def line_stamps(c: httpx.Client, run_id: str) -> dict[int, float]:
    """When the job wrote each progress line (its t_line_ms field), by line number."""
    out: dict[int, float] = {}
    for m in c.get(f"/api/runs/{run_id}").json()["milestones"]:
        fields = m.get("fields") or {}
        if m["kind"] == "progress" and "t_line_ms" in fields:
            out[int(fields["samples_done"]) // 8] = float(fields["t_line_ms"])
    return out


def latency(
    c: httpx.Client,
    browser: Any,
    url: str,
    agent: AgentHost,
    tmp: Path,
    n: int,
    ssh: str = "local",
    gap_s: float = 0.1,
) -> tuple[list[float], list[float]]:
    """Milliseconds from each progress line's write (and from the bench's wake-up of the job) to its <li>;
    each line ``gap_s`` after the last one's milestone reached the DOM."""
    fifo = tmp / f"wake-{ssh}-{gap_s}"
    os.mkfifo(fifo)
    run_id = start_run(
        c, agent, tmp / f"out-lat-{ssh}-{gap_s}", "--progress", str(n), "--delay", "0",
        "--wait-fifo", str(fifo), "--stamp", ssh=ssh,
    )  # fmt: skip
    page = browser.new_page(base_url=url, bypass_csp=True)
    page.goto(f"/runs/{run_id}")
    page.wait_for_selector("#live-status[data-state=live]")
    page.evaluate(OBSERVER)
    page.wait_for_function(
        "document.querySelectorAll('#timeline .ms-engine_ready').length > 0", timeout=60000
    )
    sent: list[float] = []
    wake = os.open(fifo, os.O_WRONLY)  # the job opened it for reading before its first progress line
    try:
        for i in range(1, n + 1):
            sent.append(time.time() * 1000)
            os.write(wake, b"\n")
            page.wait_for_function(f"window.__seen.length >= {i}", timeout=30000, polling=5)
            time.sleep(gap_s)
    finally:
        os.close(wake)
    seen: list[float] = page.evaluate("window.__seen")
    page.close()
    wrote = line_stamps(c, run_id)
    c.post(f"/api/runs/{run_id}/stop")
    from_line = [s - wrote[i] for i, s in enumerate(seen, start=1)]
    return from_line, [s - t for s, t in zip(seen, sent, strict=True)]


def ssh_latency(
    measure: Callable[..., tuple[list[float], list[float]]],
    alias: str,
    gap_s: float,
    where: str,
    local: list[float],
) -> None:
    """The latency through the SSH link, paced and back to back (``measure``: ``latency`` for one set-up);
    ``local``: the local pipes' figures."""
    ssh_lat, ssh_woke = measure(ssh=alias, gap_s=gap_s)
    p50, p99 = pct(ssh_lat, 0.5), pct(ssh_lat, 0.99)
    print(
        f"through the SSH link: p50 {p50:.1f} ms, p99 {p99:.1f} ms,"
        f" max {max(ssh_lat):.1f} ms (goal p99 <= 50 ms);"
        f" from wake-up p50 {pct(ssh_woke, 0.5):.1f} ms, p99 {pct(ssh_woke, 0.99):.1f} ms"
    )
    note = f"{len(ssh_lat)} milestones; loopback sshd; {where}; baseline = the same over local pipes"
    for q, value, goal in ((50, p50, None), (99, p99, "<= 50")):
        bench_line(
            "ui_latency", f"ssh line_to_dom_p{q}", round(value, 1), "ms",
            goal=goal, baseline=round(pct(local, q / 100), 1), note=note,
        )  # fmt: skip
    if gap_s <= 0:
        return
    stress, _ = measure(ssh=alias, gap_s=0)
    p50, p99 = pct(stress, 0.5), pct(stress, 0.99)
    print(f"through the SSH link, back to back: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(stress):.1f} ms")
    bench_line(
        "ui_latency", "ssh line_to_dom_p99 back-to-back", round(p99, 1), "ms",
        note=f"{len(stress)} milestones, each line once the last milestone was in the DOM; p50 {p50:.1f}",
    )  # fmt: skip


def heavy_page(
    c: httpx.Client, browser: Any, url: str, agent: AgentHost, tmp: Path, lines: int, ms: int
) -> None:
    """Weight and first render of a run page with many log lines and milestones, against an empty run."""
    empty = start_run(c, agent, tmp / "out-empty", "--progress", "0", "--delay", "0")
    heavy = start_run(
        c, agent, tmp / "out-heavy", "--progress", "0", "--delay", "0", "--flood", str(lines),
        "--flood-milestones", str(ms),
    )  # fmt: skip
    t0 = time.monotonic()

    def ingested() -> bool:
        d = c.get(f"/api/runs/{heavy}").json()
        if d["state"] != "completed" or len(d["milestones"]) < ms:
            return False
        tail = c.get(f"/api/runs/{heavy}/log", params={"after": -1, "limit": 1}).json()
        return bool(tail)

    wait_until(ingested, 900, interval=1.0, what="heavy run ingested")
    wait_until(lambda: c.get(f"/api/runs/{empty}").json()["state"] == "completed", 60, what="empty run")
    print(f"ingest: {lines:,} lines + {ms:,} milestones stored in {time.monotonic() - t0:.1f} s")
    results = {}
    for label, run_id in (("empty run", empty), ("heavy run", heavy)):
        html = c.get(f"/runs/{run_id}").content
        assets = sum(
            len(c.get(p).content) for p in ("/static/app.js", "/static/app.css", "/static/favicon.svg")
        )
        page = browser.new_page(base_url=url, viewport={"width": 1280, "height": 900})
        start = time.monotonic()
        page.goto(f"/runs/{run_id}", wait_until="load")
        page.wait_for_selector("#log .ln")
        wall = (time.monotonic() - start) * 1000
        nav = page.evaluate(
            "() => { const n = performance.getEntriesByType('navigation')[0];"
            " const p = performance.getEntriesByName('first-contentful-paint')[0];"
            " return {dcl: n.domContentLoadedEventEnd, load: n.loadEventEnd, fcp: p ? p.startTime : null,"
            " nodes: document.getElementsByTagName('*').length}; }"
        )
        t = time.monotonic()
        page.mouse.wheel(0, -3000)
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        scroll = (time.monotonic() - t) * 1000
        results[label] = len(html) + assets
        key = "empty" if label == "empty run" else "heavy"
        bench_line("ui_latency", f"{key}_run_page_kib", round(len(html) / 1024, 1), "KiB")
        bench_line("ui_latency", f"{key}_run_first_contentful_paint", round(nav["fcp"] or 0, 1), "ms")
        print(
            f"{label:10s}: page {len(html) / 1024:8.1f} KiB + assets {assets / 1024:5.1f} KiB;"
            f" FCP {nav['fcp'] or 0:6.0f} ms, DOMContentLoaded {nav['dcl']:6.0f} ms,"
            f" load {nav['load']:6.0f} ms,"
            f" log visible {wall:6.0f} ms, DOM nodes {nav['nodes']:,}, scroll frame {scroll:5.1f} ms"
        )
        if key == "heavy":
            (ROOT / "test-output").mkdir(exist_ok=True)
            page.screenshot(path=str(ROOT / "test-output" / "bench-heavy-run.png"))
        page.close()
    ratio = results["heavy run"] / results["empty run"]
    print(f"page weight ratio heavy/empty: {ratio:.2f}x")
    bench_line(
        "ui_latency",
        "heavy_vs_empty_page_weight",
        round(ratio, 2),
        "x",
        note=f"{lines} lines, {ms} milestones",
    )


def main() -> int:
    """Run both measurements and print the numbers."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--milestones", type=int, default=200)
    ap.add_argument("--no-heavy", action="store_true", help="only the latency, not the heavy page")
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--heavy-milestones", type=int, default=1000)
    ap.add_argument("--gap-ms", type=float, default=100.0, help="pause after each milestone reached the DOM")
    args = ap.parse_args()
    if not Path(CHROMIUM).exists():
        print(f"cannot run here: no Chromium at {CHROMIUM}")
        return SKIP_EXIT
    if os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1":
        args.milestones, args.lines, args.heavy_milestones = 50, 20_000, 200
    tmp = Path(tempfile.mkdtemp(prefix="ewbench"))
    agent = AgentHost(Path(tempfile.mkdtemp(prefix="ewa", dir="/tmp")))
    sshd = SSHD.start(tmp / "sshd") if Path(SSHD_BIN).exists() else None
    settings = settings_for(tmp / "home")
    if sshd is not None:
        settings = settings.model_copy(
            update={
                "known_hosts": sshd.known_hosts,
                "ssh_config": sshd.ssh_config,
                "remote_base": str(tmp / "remote"),
            }
        )
    srv = ApartServer(settings.model_dump_json())
    where = "controller in its own process"
    gap_s = args.gap_ms / 1000
    where += f", milestones {args.gap_ms:g} ms apart"
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c, sync_playwright() as p:
            c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                lat, woke = latency(c, browser, srv.url, agent, tmp, args.milestones, gap_s=gap_s)
                print(
                    f"log line -> milestone in DOM over {len(lat)} milestones: p50 {pct(lat, 0.5):.1f} ms,"
                    f" p90 {pct(lat, 0.9):.1f} ms, p99 {pct(lat, 0.99):.1f} ms, max {max(lat):.1f} ms,"
                    f" mean {statistics.fmean(lat):.1f} ms ({where});"
                    f" from wake-up p50 {pct(woke, 0.5):.1f} ms, p99 {pct(woke, 0.99):.1f} ms"
                )
                bench_line("ui_latency", "line_to_dom_p50", round(pct(lat, 0.5), 1), "ms")
                bench_line("ui_latency", "line_to_dom_p99", round(pct(lat, 0.99), 1), "ms")
                if sshd is not None:
                    measure = functools.partial(latency, c, browser, srv.url, agent, tmp, args.milestones)
                    ssh_latency(measure, sshd.alias, gap_s, where, lat)
                if not args.no_heavy:
                    heavy_page(c, browser, srv.url, agent, tmp, args.lines, args.heavy_milestones)
            finally:
                browser.close()
    finally:
        srv.stop()
        agent.cleanup()
        if sshd is not None:
            sshd.stop()
            kill_tree_matching(str(tmp) + "/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
