"""Where a milestone's milliseconds go, hop by hop, from the host's log to Chromium's DOM (through SSH).

    .venv/bin/python tests/bench/bench_ui_hops.py [--milestones 200] [--local]

The same set-up as bench_ui_latency.py (real uvicorn, Controller, agent daemon uploaded over a loopback
OpenSSH sshd, Chromium), with a wall-clock stamp taken at each hop of one progress milestone:

    bump      the benchmark wakes the job (a line into the named pipe the job blocks on)
    line      the job writes the line (t_line_ms in the record)
    journal   the agent's watcher journals the milestone (the event's ts, before the journal's fsync)
    link      the controller's link reader hands the stream message on (HostSupervisor.on_stream)
    store     the writer thread applies it (crud.apply_event_batch called)
    bus       the committed event is published on the bus (event loop)
    sse       the SSE stream formats it for the page (web.sse.to_sse)
    socket    a plain HTTP client of the same event stream, in a process of its own, reads it
    browser   the page's EventSource dispatches it (page clock, performance.timeOrigin + now())
    dom       the milestone's <li> is inserted (MutationObserver)

Milestones come ``--gap-ms`` (100) apart, as in bench_ui_latency.py; ``--gap-ms 0`` runs them back to back.
``--trace FILE`` records a Chromium performance trace (the renderer's tasks: layout, paint, frame callbacks)
and the slowest milestones are broken down hop by hop.
Then (through SSH) the link hop alone: ``version`` round trips over a direct-streamlocal channel to the
daemon's socket and over the ``eaglewatch-agent connect`` bridge, alternating.

The controller runs in this process (uvicorn in a thread), so the hooks wrap its functions here; nothing in
the product carries tracing code.  All clocks are this machine's wall clock (agent, job and browser run
here too).  Prints p50/p99 of each hop's increment and of the total, one BENCH line per hop.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

import web.sse  # noqa: E402
from controller import crud  # noqa: E402
from controller.bus import Bus, BusEvent  # noqa: E402
from controller.supervisor import HostSupervisor  # noqa: E402
from tests.bench.bench_ui_latency import CHROMIUM, OBSERVER, pct, start_run  # noqa: E402
from tests.bench.run_all import SKIP_EXIT, bench_line  # noqa: E402
from tests.helpers.sshd import SSHD, SSHD_BIN, kill_tree_matching  # noqa: E402
from tests.web.conftest import CHROMIUM_ARGS, AgentHost, settings_for, start_server, wait_until  # noqa: E402

HOPS = ("bump", "line", "journal", "link", "store", "bus", "sse", "socket", "browser", "dom")
#: The page's EventSource, wrapped before app.js runs: when each progress milestone event arrives.
ES_HOOK = """(() => {
  window.__recv = {};
  const add = EventSource.prototype.addEventListener;
  EventSource.prototype.addEventListener = function (kind, fn, opts) {
    if (kind === 'milestone') {
      const inner = fn;
      fn = function (ev) {
        const t = performance.timeOrigin + performance.now();
        try {
          const d = JSON.parse(ev.data);
          if (d.kind === 'progress') window.__recv[d.fields.samples_done / 8] = t;
        } catch (e) {}
        return inner.call(this, ev);
      };
    }
    return add.call(this, kind, fn, opts);
  };
})()"""

stamps: dict[int, dict[str, float]] = defaultdict(dict)


def _index(fields: Any) -> int | None:
    """The progress line's number (the job writes samples_done = 8 × line number)."""
    if isinstance(fields, dict) and isinstance(fields.get("samples_done"), int):
        return int(fields["samples_done"]) // 8
    return None


def install_hooks() -> None:
    """Wrap the controller's hops in this process so each stamps the wall clock."""
    on_stream, apply_batch, publish, to_sse = (
        HostSupervisor.on_stream, crud.apply_event_batch, Bus.publish, web.sse.to_sse,
    )  # fmt: skip

    async def traced_on_stream(self: HostSupervisor, msg: dict[str, Any]) -> None:
        ev = msg.get("event")
        if isinstance(ev, dict) and ev.get("kind") == "progress" and (i := _index(ev.get("fields"))):
            stamps[i]["link"] = time.time() * 1000
            stamps[i]["journal"] = float(ev.get("ts") or 0) * 1000
        await on_stream(self, msg)

    def traced_apply(**kw: Any) -> int:
        now = time.time() * 1000
        for _run, ev in kw["events"]:
            if ev.get("kind") == "progress" and (i := _index(ev.get("fields"))):
                stamps[i]["store"] = now
        return apply_batch(**kw)

    def progress_index(event: BusEvent) -> int | None:
        if event.kind == "milestone" and event.data.get("kind") == "progress":
            return _index(event.data.get("fields"))
        return None

    def traced_publish(self: Bus, event: BusEvent) -> None:
        if i := progress_index(event):
            stamps[i].setdefault("bus", time.time() * 1000)
        publish(self, event)

    def traced_to_sse(event: BusEvent) -> Any:
        if i := progress_index(event):
            stamps[i].setdefault("sse", time.time() * 1000)
        return to_sse(event)

    HostSupervisor.on_stream = traced_on_stream  # type: ignore[method-assign]
    crud.apply_event_batch = traced_apply
    Bus.publish = traced_publish  # type: ignore[method-assign]
    web.sse.to_sse = traced_to_sse


#: A plain HTTP client of the run's event stream, in a process of its own (only httpx imported): it says
#: "ready" once the stream is open, then the wall clock at which each progress milestone arrives.
READER = """
import json, sys, time, httpx
url, run_id, out = sys.argv[1:]
with open(out, "a") as fh, httpx.Client(base_url=url, timeout=None) as c, c.stream(
    "GET", f"/api/runs/{run_id}/events", params={"after": "now"}
) as r:
    fh.write(f"ready {r.status_code}\\n"); fh.flush()
    for line in r.iter_lines():
        if line.startswith("data:") and '"progress"' in line:
            d = json.loads(line[5:])
            if d.get("kind") == "progress":
                fh.write(f"{d['fields']['samples_done'] // 8} {time.time() * 1000}\\n"); fh.flush()
"""


def measure(
    c: httpx.Client, browser: Any, url: str, agent: AgentHost, tmp: Path, n: int, ssh: str, gap_s: float
) -> None:
    """Bump the counter n times, each ``gap_s`` after the last milestone reached the DOM; stamps fill
    ``stamps``."""
    fifo = tmp / "wake-hops"
    os.mkfifo(fifo)
    run_id = start_run(
        c, agent, tmp / "out-hops", "--progress", str(n), "--delay", "0", "--wait-fifo", str(fifo),
        "--stamp", ssh=ssh,
    )  # fmt: skip
    got = tmp / "socket-stamps"
    reader = subprocess.Popen([sys.executable, "-c", READER, url, run_id, str(got)])
    wait_until(lambda: got.exists() and got.read_text().startswith("ready"), 30, what="stream reader")
    page = browser.new_page(base_url=url, bypass_csp=True)
    page.add_init_script(ES_HOOK)
    page.goto(f"/runs/{run_id}")
    page.wait_for_selector("#live-status[data-state=live]")
    page.evaluate(OBSERVER)
    page.wait_for_function(
        "document.querySelectorAll('#timeline .ms-engine_ready').length > 0", timeout=60000
    )
    wake = os.open(fifo, os.O_WRONLY)
    try:
        for i in range(1, n + 1):
            stamps[i]["bump"] = time.time() * 1000
            os.write(wake, b"\n")
            page.wait_for_function(f"window.__seen.length >= {i}", timeout=30000, polling=5)
            time.sleep(gap_s)
    finally:
        os.close(wake)
    seen: list[float] = page.evaluate("window.__seen")
    recv: dict[str, float] = page.evaluate("window.__recv")
    lines = c.get(f"/api/runs/{run_id}").json()["milestones"]
    page.close()
    reader.terminate()
    reader.wait()
    c.post(f"/api/runs/{run_id}/stop")
    for row in got.read_text().split("\n"):
        if row and not row.startswith("ready"):
            num, at = row.split()
            stamps[int(num)]["socket"] = float(at)
    for m in lines:
        n_line = _index(m.get("fields"))
        if m["kind"] == "progress" and n_line and "t_line_ms" in m["fields"]:
            stamps[n_line]["line"] = float(m["fields"]["t_line_ms"])
    for k, at_dom in enumerate(seen, start=1):
        stamps[k]["dom"] = at_dom
        if str(k) in recv:
            stamps[k]["browser"] = recv[str(k)]


def report(n: int) -> None:
    """Each hop's increment (p50, p99, mean) over the milestones that have every stamp, and the total."""
    rows = [stamps[i] for i in range(1, n + 1) if all(h in stamps[i] for h in HOPS)]
    print(f"{len(rows)} of {n} milestones carry every stamp")
    if not rows:
        return
    for a, b in [*itertools.pairwise(HOPS), ("line", "dom"), ("bump", "dom")]:
        d = [r[b] - r[a] for r in rows]
        p50, p99 = pct(d, 0.5), pct(d, 0.99)
        mean = sum(d) / len(d)  # means add up along the path, quantiles do not
        print(f"{a:>8s} -> {b:<8s} p50 {p50:7.2f}  mean {mean:7.2f}  p99 {p99:7.2f}  max {max(d):7.2f} ms")
        bench_line("ui_hops", f"{a}->{b} p99", round(p99, 2), "ms", note=f"p50 {p50:.2f}")
    # The tail, hop by hop: where the slowest milestones lost their time.
    slow = sorted(rows, key=lambda r: r["dom"] - r["line"])[-5:]
    print("slowest line -> dom, ms per hop: " + " ".join(f"{b}" for b in HOPS[2:]))
    for r in reversed(slow):
        steps = " ".join(f"{r[b] - r[a]:.1f}" for a, b in itertools.pairwise(HOPS[1:]))
        print(f"  {r['dom'] - r['line']:6.1f}: {steps}")


def link_round_trips(settings: Any, state_dir: Path, alias: str, n: int) -> None:
    """Milliseconds per ``version`` request through the direct channel and through the connect bridge,
    alternating (the same load on both): the hop that the direct path takes a process out of."""
    from controller.bootstrap import open_link

    async def go() -> dict[str, list[float]]:
        host = {"name": "rt", "ssh": alias, "python": sys.executable, "state_dir": str(state_dir)}
        links = {}
        for direct in (True, False):
            link, _ = await open_link(host, settings, None, direct=direct)
            links[link.route] = link
        out: dict[str, list[float]] = {route: [] for route in links}
        try:
            for _ in range(n):
                for route, link in links.items():
                    t = time.perf_counter()
                    await link.request("version", timeout=30)
                    out[route].append((time.perf_counter() - t) * 1000)
        finally:
            for link in links.values():
                await link.close()
        return out

    for route, took in asyncio.run(go()).items():
        p50, p99 = pct(took, 0.5), pct(took, 0.99)
        print(f"link round trip via {route:18s} p50 {p50:6.2f}  p99 {p99:6.2f}  max {max(took):6.2f} ms")
        bench_line("ui_hops", f"link round trip p99 via {route}", round(p99, 2), "ms", note=f"p50 {p50:.2f}")


def main() -> int:
    """Trace n milestones through the SSH link (or local pipes with --local) and print the hops."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--milestones", type=int, default=200)
    ap.add_argument("--local", action="store_true", help="the agent over local pipes instead of SSH")
    ap.add_argument("--round-trips", type=int, default=500, help="version requests per link path")
    ap.add_argument("--gap-ms", type=float, default=100.0, help="pause after each milestone reached the DOM")
    ap.add_argument("--trace", type=Path, help="write a Chromium performance trace of the run to this file")
    args = ap.parse_args()
    if os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1":
        args.milestones = 50
    if not Path(CHROMIUM).exists() or (not args.local and not Path(SSHD_BIN).exists()):
        print("cannot run here: needs Chromium and OpenSSH's sshd")
        return SKIP_EXIT
    install_hooks()
    tmp = Path(tempfile.mkdtemp(prefix="ewbench"))
    agent = AgentHost(Path(tempfile.mkdtemp(prefix="ewa", dir="/tmp")))
    sshd = None if args.local else SSHD.start(tmp / "sshd")
    settings = settings_for(tmp / "home")
    if sshd is not None:
        remote = str(tmp / "remote")
        settings = settings.model_copy(
            update={"known_hosts": sshd.known_hosts, "ssh_config": sshd.ssh_config, "remote_base": remote}
        )
    srv = start_server(tmp / "home", settings=settings)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c, sync_playwright() as p:
            c.headers["x-csrf-token"] = c.get("/api/csrf").json()["csrf_token"]
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                host = "local" if sshd is None else sshd.alias
                if args.trace is not None:  # the renderer's tasks: what holds an event's dispatch up
                    browser.start_tracing(categories=["devtools.timeline", "toplevel", "blink", "loading"])
                measure(c, browser, srv.url, agent, tmp, args.milestones, host, args.gap_ms / 1000)
                if args.trace is not None:
                    args.trace.write_bytes(browser.stop_tracing())
            finally:
                browser.close()
        if sshd is not None:
            link_round_trips(settings, agent.state_dir, sshd.alias, args.round_trips)
    finally:
        srv.stop()
        agent.cleanup()
        if sshd is not None:
            sshd.stop()
            kill_tree_matching(str(tmp) + "/")
    report(args.milestones)
    return 0


if __name__ == "__main__":
    sys.exit(main())
