"""Benchmark: one controller and a fleet of agents reached through the real loopback sshd.

Fleet load: ``--hosts`` host entries (aliases of one sshd on 127.0.0.1), each an agent with its own state
directory; ``--runs`` jobs per host, each writing a realistic steady-state vLLM log (debug chatter, stats
lines, a progress milestone every couple of seconds; tests/helpers/vllm_log.py) at ``--rate`` lines/s, every
fifth line a timestamped stamp, and a small capture file every 100 lines into its output_dir (checked by its
agent: file written -> checked, from each file's mtime and its shape check's time).  Measured while it runs:
line -> stored (committed) p50/p99 from the stamps, the controller process's CPU (cores) and RSS, the lines/s
actually reached; afterwards every run's stored stamps are read back (lost or duplicated), and SQLite bytes
per stored line.  The first run's page is open in Chromium all along, served by uvicorn on the controller's
loop: line -> browser DOM from its stamps (on a machine without Chromium: line -> the page's event stream).
Restart: the controller, run as a process of its own, is SIGKILLed while it stores lines; the jobs go on
writing for ``--backlog`` seconds, a fresh controller starts: the time until every run's stored log reaches
what its job had written when it started again.
History: the dashboard with 10,000 runs and the run page of a run with 1,000,000 lines (in-process ASGI).

Run: ``.venv/bin/python tests/bench/bench_fleet.py [--hosts 8] [--runs 8] [--rate 50] [--duration 60]``
``--history-only`` times just the history pages, ``--load-only`` just the load.  Prints BENCH lines for
``run_all.py``; exits 77 without ``/usr/sbin/sshd``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from agent.spec import parse_spec  # noqa: E402
from controller.models import HostCreate  # noqa: E402
from controller.service import Controller  # noqa: E402
from controller.settings import Settings  # noqa: E402
from tests.bench.bench_link import pct  # noqa: E402
from tests.bench.run_all import SKIP_EXIT, bench_line  # noqa: E402
from tests.helpers.controllerproc import spawn_controller  # noqa: E402
from tests.helpers.history import seed_log, seed_runs  # noqa: E402
from tests.helpers.sshd import SSHD, SSHD_BIN, kill_tree_matching  # noqa: E402
from tests.helpers.vllm_log import steady_lines  # noqa: E402
from tests.web.conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from web.app import create_app  # noqa: E402

#: Each stamp line's first appearance in the run page's log view: page clock minus the stamp's write time.
DOM_OBSERVER = """() => {
  window.__dom = []; const seen = new Set();
  new MutationObserver((muts) => {
    const t = performance.timeOrigin + performance.now();
    for (const m of muts) for (const n of m.addedNodes) {
      const got = /^fleetstamp (\\d+) ([\\d.]+)/.exec(n.textContent || "");
      if (got && !seen.has(got[1])) { seen.add(got[1]); window.__dom.push(t - Number(got[2]) * 1000); }
    }
  }).observe(document.getElementById('log-inner'), {childList: true});
}"""

# The job: the template's lines at ``rate`` lines/s; every STAMP-th line "fleetstamp <i> <time>"; every
# FILE_EVERY-th line a capture file hs_<k>.safetensors (16 tokens x 4 layers x 64, bf16) written atomically
# into ``out``, as an extraction's writer does.
JOB = """\
import json, os, struct, sys, time
go, template, rate, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
T, L, H, FILE_EVERY = 16, 4, 64, 100
states = b"\\x80\\x3f" * (T * L * H)  # 1.0 in bf16
header = json.dumps({
    "hidden_states": {"dtype": "BF16", "shape": [T, L, H], "data_offsets": [0, len(states)]},
    "token_ids": {"dtype": "I64", "shape": [T], "data_offsets": [len(states), len(states) + 8 * T]},
}).encode()
header += b" " * (-len(header) % 8)
body = struct.pack("<Q", len(header)) + header + states + struct.pack(f"<{T}q", *range(T))
lines = open(template).read().splitlines()
while not os.path.exists(go):
    time.sleep(0.05)
start = time.time()
log = sys.stdout
i = stamp = files = 0
while True:
    delay = start + i / rate - time.time()
    if delay > 0:
        time.sleep(delay)
    if i % 5 == 0:
        log.write(f"fleetstamp {stamp} {time.time():.6f}\\n")
        stamp += 1
    else:
        log.write(lines[i % len(lines)] + "\\n")
    log.flush()
    if i % FILE_EVERY == FILE_EVERY - 1:
        tmp = os.path.join(out, f".hs_{files}.tmp")
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, os.path.join(out, f"hs_{files}.safetensors"))
        files += 1
    i += 1
"""


def rss_mb() -> float:
    """This process's resident memory now, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def history() -> None:
    """The dashboard with 10,000 runs; the run page of a run with 1,000,000 lines."""
    from web.app import create_app

    tmp = Path(tempfile.mkdtemp(prefix="ew-bench-hist-"))
    async with Controller(Settings(home=tmp / "home"), supervise=False) as ctl:
        ids = seed_runs(ctl.settings.database, 10_000)
        seed_log(ctl.settings.database, ids[-1], 1_000_000)
        app = create_app(ctl)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
        ) as c:
            for label, url, goal in (
                ("dashboard, 10000 runs", "/", "<= 200"),
                ("api runs page, 10000 runs", "/api/runs?offset=9900", "<= 200"),
                ("run page, 1000000 lines", f"/runs/{ids[-1]}", "<= 1000"),
            ):
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    r = await c.get(url)
                    times.append((time.perf_counter() - t0) * 1000)
                    assert r.status_code == 200, r.text[:300]
                print(f"{label}: p50 {pct(times, 50):.1f} ms, max {max(times):.1f} ms")
                bench_line("fleet", label, round(pct(times, 50), 1), "ms", goal=goal, note="p50 of 10")
        before = ctl.settings.database.stat().st_size
        t0 = time.perf_counter()
        await ctl.store.write(lambda tx: tx.conn.execute("UPDATE runs SET ended_at=0 WHERE id=?", (ids[-1],)))
        done = await ctl.gc(86400)
        dt = time.perf_counter() - t0
        print(
            f"gc of 1000000 lines: {dt:.2f}s,"
            f" database {before / 1e6:.1f} -> {done['bytes_after'] / 1e6:.1f} MB"
        )
        bench_line(
            "fleet", "gc 1000000 lines", round(dt, 2), "s", note=f"db {before} -> {done['bytes_after']} B"
        )


class Fleet:
    """The sshd, the job script and the per-host settings of one bench run."""

    def __init__(self, tmp: Path, hosts: int) -> None:
        self.tmp = tmp
        self.sshd = SSHD.start(tmp / "sshd")
        # Every host entry is an alias of the one sshd: one more Host name on its config's first line.
        cfg = self.sshd.ssh_config.read_text().split("\n", 1)
        self.names = [f"fleet-{i:02d}" for i in range(hosts)]
        self.sshd.ssh_config.write_text(f"{cfg[0]} {' '.join(self.names)}\n{cfg[1]}")
        self.job = tmp / "job.py"
        self.job.write_text(JOB)
        self.template = tmp / "template.log"
        self.template.write_text("\n".join(steady_lines(20_000)) + "\n")
        self.go = tmp / "go"
        self.settings = Settings(
            home=tmp / "home",
            known_hosts=self.sshd.known_hosts,
            ssh_config=self.sshd.ssh_config,
            remote_base=str(tmp / "remote"),
            stall_min_s=3600,
        )

    def log_of(self, host: str, run_id: str) -> Path:
        """Where the job of ``run_id`` on ``host`` writes its log."""
        return self.tmp / "agents" / host / "runs" / run_id / "output.log"


async def stored_offsets(ctl: Controller) -> dict[str, int]:
    """Each run's stored log frontier."""
    rows = await ctl.store.read(lambda conn: conn.execute("SELECT id, log_offset FROM runs").fetchall())
    return {r[0]: r[1] for r in rows}


def check_lag(db: Path, outs: dict[str, Path]) -> tuple[list[float], int, int]:
    """Each checked capture file's lag (its shape check's time minus the file's mtime, seconds), the files
    checked and the files written (``outs``: each run's output_dir)."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute(
            "SELECT run_id, at, fields_json FROM milestones"
            " WHERE kind IN ('shape_check_passed', 'shape_check_failed')"
        ).fetchall()
    finally:
        conn.close()
    lags = []
    for run_id, at, fields in rows:
        name = json.loads(fields).get("file")
        if name and run_id in outs:
            lags.append(at - (outs[run_id] / name).stat().st_mtime)
    written = sum(len(list(out.glob("hs_*.safetensors"))) for out in outs.values())
    return lags, len(lags), written


async def check_stamps(ctl: Controller, run_ids: list[str]) -> tuple[int, int, int]:
    """Stored stamps of every run read back: (stored lines, lost stamps, duplicated stamps)."""
    lines = lost = dup = 0
    for rid in run_ids:
        seen: list[int] = []
        after = -1
        while page := await ctl.read_log(rid, after_offset=after, limit=100_000):
            lines += len(page)
            seen += [int(ln["text"].split()[1]) for ln in page if ln["text"].startswith("fleetstamp ")]
            after = page[-1]["offset"]
        dup += len(seen) - len(set(seen))
        lost += (max(seen) + 1 - len(set(seen))) if seen else 0
    return lines, lost, dup


async def sigkill_mid_ingest(settings: Settings) -> None:
    """Start the controller as a process of its own, wait until it stores lines, SIGKILL it."""
    db = settings.database
    proc = spawn_controller(settings, EAGLEWATCH_STALL_MIN_S=str(settings.stall_min_s))
    try:
        before = _frontier(db)
        deadline = time.time() + 120
        while _frontier(db) <= before and time.time() < deadline:
            await asyncio.sleep(0.1)
        if time.time() >= deadline:
            raise RuntimeError(f"the controller stored nothing in 120 s: see {settings.home / 'ctl.log'}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _frontier(db: Path) -> int:
    """The sum of every run's stored log offset, read beside the controller."""
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT coalesce(sum(log_offset), 0) FROM runs").fetchone()[0])
    finally:
        conn.close()


#: Where the load's hosts and jobs find Python (the agent needs only the standard library).
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


@contextlib.asynccontextmanager
async def run_page(
    ctl: Controller, run_id: str
) -> AsyncIterator[tuple[str, Callable[[], Awaitable[list[float]]]]]:
    """The run page of ``run_id`` in Chromium, served by uvicorn on the controller's own loop (as `eaglewatch
    serve` does), its log view observed (DOM_OBSERVER).  Yields where it times lines, and what takes the
    line -> DOM latencies (ms) seen since the last take.  Where Chromium cannot run (a machine without it),
    the page's own event stream is read instead: line -> the event's arrival at the client's socket."""
    app = create_app(ctl, manage_controller=False)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="none", lifespan="on")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        if Path(CHROMIUM).exists():
            from playwright.async_api import async_playwright

            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    page = await browser.new_page(base_url=base)
                    await page.goto(f"/runs/{run_id}")
                    await page.wait_for_selector("#live-status[data-state=live]")
                    await page.evaluate(DOM_OBSERVER)

                    async def take_dom() -> list[float]:
                        return list(await page.evaluate("window.__dom.splice(0)"))

                    yield "DOM", take_dom
                finally:
                    await browser.close()
        else:
            print(f"no Chromium at {CHROMIUM}: line -> page is timed at the page's event stream")
            seen: list[float] = []
            reading = asyncio.create_task(read_stream(base, run_id, seen))

            async def take_sse() -> list[float]:
                got = seen[:]
                del seen[:]
                return got

            try:
                yield "event stream", take_sse
            finally:
                reading.cancel()
    finally:
        server.should_exit = True
        await serving


async def read_stream(base: str, run_id: str, seen: list[float]) -> None:
    """Follow the run page's event stream; each stamp's latency (ms) from its write to its arrival."""
    async with (
        httpx.AsyncClient(base_url=base, timeout=None) as client,
        client.stream("GET", f"/api/runs/{run_id}/events") as resp,
    ):
        async for line in resp.aiter_lines():
            if line.startswith("data:") and "fleetstamp " in line:
                now = time.time()
                for text in json.loads(line[5:]).get("text", "").split("\n"):
                    if text.startswith("fleetstamp "):
                        seen.append((now - float(text.split()[2])) * 1000)


async def load(args: argparse.Namespace) -> None:
    """The fleet load, its read-back, and the restart."""
    tmp = Path(tempfile.mkdtemp(prefix="ew-bench-fleet-"))
    fleet = Fleet(tmp, args.hosts)
    runs: dict[str, str] = {}  # run id -> host
    outs: dict[str, Path] = {}  # run id -> its output_dir
    try:
        ctl = Controller(fleet.settings)
        await ctl.start()
        for name in fleet.names:
            await ctl.add_host(
                HostCreate(name=name, ssh=name, python=PYTHON, state_dir=str(tmp / "agents" / name))
            )
        await asyncio.wait_for(
            asyncio.gather(*(ctl.supervisors.hosts[n].connected.wait() for n in fleet.names)), 300
        )
        for name in fleet.names:
            for j in range(args.runs):
                out = tmp / "out" / f"{name}-{j}"
                out.mkdir(parents=True)
                spec = {
                    "host": name, "backend": "command", "name": f"{name}-{j}", "output_dir": str(out),
                    "command": [PYTHON, str(fleet.job), str(fleet.go), str(fleet.template),
                                str(args.rate), str(out)],
                }  # fmt: skip
                rid = await ctl.create_run(parse_spec(spec))
                runs[rid], outs[rid] = name, out
        lat: list[float] = []
        committed = 0
        sub = ctl.bus.subscribe()

        async def consume() -> None:
            nonlocal committed
            async for ev in sub:
                if ev.kind != "log":
                    continue
                now = time.time()
                for text in ev.data["text"].split("\n"):
                    committed += 1
                    if text.startswith("fleetstamp "):
                        lat.append(now - float(text.split()[2]))

        task = asyncio.create_task(consume())
        async with run_page(ctl, next(iter(runs))) as (where, take_page):
            fleet.go.write_text("")
            await asyncio.sleep(5)  # warm-up: every job writing
            lat.clear()
            await take_page()
            c0, t0, n0 = time.process_time(), time.time(), committed
            peak = 0.0
            while time.time() - t0 < args.duration:
                await asyncio.sleep(1)
                peak = max(peak, rss_mb())
            cores = (time.process_time() - c0) / (time.time() - t0)
            rate = (committed - n0) / (time.time() - t0)
            dom = await take_page()
        task.cancel()
        sub.close()
        ms = [v * 1000 for v in lat]
        target = args.hosts * args.runs * args.rate
        note = f"{args.hosts} hosts x {args.runs} runs x {args.rate:.0f} lines/s, {args.duration:.0f}s"
        print(f"fleet {note}: reached {rate:,.0f} of {target:,.0f} lines/s stored")
        print(f"  line -> stored: p50 {pct(ms, 50):.1f} ms  p99 {pct(ms, 99):.1f} ms  max {max(ms):.1f} ms")
        print(f"  line -> {where} of one run page: p50 {pct(dom, 50):.1f} ms  p99 {pct(dom, 99):.1f} ms")
        print(f"  controller (with the page's server): {cores:.2f} cores, RSS peak {peak:.0f} MB")
        bench_line("fleet", "lines/s stored", round(rate), "lines/s", note=f"{note}; target {target:.0f}")
        bench_line("fleet", "line -> stored p50", round(pct(ms, 50), 1), "ms", note=note)
        bench_line("fleet", "line -> stored p99", round(pct(ms, 99), 1), "ms", goal="<= 250", note=note)
        paged = f"{note}; one run page open" + ("" if where == "DOM" else ", timed at its event stream")
        bench_line("fleet", "line -> DOM p50", round(pct(dom, 50), 1), "ms", note=paged)
        bench_line("fleet", "line -> DOM p99", round(pct(dom, 99), 1), "ms", note=paged)
        bench_line("fleet", "controller CPU", round(cores, 2), "cores", goal="<= 1", note=note)
        bench_line("fleet", "controller RSS", round(peak), "MB", goal="<= 500", note=note)
        # Restart: the controller is SIGKILLed mid-ingest (a process of its own, as `eaglewatch serve` runs),
        # the jobs build a backlog, a fresh controller starts: time its catch-up.
        await ctl.stop()
        await sigkill_mid_ingest(fleet.settings)
        await asyncio.sleep(args.backlog)
        sizes = {rid: fleet.log_of(h, rid).stat().st_size for rid, h in runs.items()}
        t0 = time.time()
        ctl = Controller(fleet.settings)
        await ctl.start()
        while True:
            stored = await stored_offsets(ctl)
            behind = [rid for rid, size in sizes.items() if stored.get(rid, 0) < size]
            if not behind or time.time() - t0 > 600:
                break
            await asyncio.sleep(0.25)
        catch_up = time.time() - t0
        print(
            f"  restart after {args.backlog:.0f}s of backlog:"
            f" caught up in {catch_up:.1f}s ({len(behind)} behind)"
        )
        why = f"{note}; {args.backlog:.0f}s backlog per run after SIGKILL; {len(behind)} runs behind"
        bench_line("fleet", "catch-up after restart", round(catch_up, 1), "s", goal="<= 30", note=why)
        await ctl.stop()
        kill_tree_matching(str(fleet.job))
        ctl = Controller(fleet.settings, supervise=False)
        await ctl.start()
        lines, lost, dup = await check_stamps(ctl, list(runs))
        await ctl.stop()
        lags, checked, written = check_lag(fleet.settings.database, outs)
        ms_lag = [v * 1000 for v in lags]
        print(f"  capture files: {checked:,} of {written:,} checked; file written -> checked"
              f" p50 {pct(ms_lag, 50):.0f} ms, p99 {pct(ms_lag, 99):.0f} ms")  # fmt: skip
        files = f"{note}; {checked} of {written} files"
        bench_line("fleet", "file written -> checked p99", round(pct(ms_lag, 99)), "ms", note=files)
        size = fleet.settings.database.stat().st_size
        print(f"  stored {lines:,} lines; lost {lost}, duplicated {dup}; database {size / 1e6:.1f} MB,"
              f" {size / max(lines, 1):.0f} bytes/line")  # fmt: skip
        bench_line("fleet", "lost stamps", lost, "lines", goal="<= 0", note=note)
        bench_line("fleet", "duplicated stamps", dup, "lines", goal="<= 0", note=note)
        bench_line(
            "fleet", "SQLite bytes per line", round(size / max(lines, 1)), "B", note=f"{note}; {size} B"
        )
    finally:
        fleet.sshd.stop()
        kill_tree_matching(str(tmp) + "/")


def main() -> None:
    """Parse the options and run the parts asked for."""
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=1 if quick else 8)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rate", type=float, default=50)
    ap.add_argument("--duration", type=float, default=20 if quick else 60)
    ap.add_argument("--backlog", type=float, default=20 if quick else 300)
    ap.add_argument("--history-only", action="store_true")
    ap.add_argument("--load-only", action="store_true")
    args = ap.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard > 0 else 4096, hard))  # 32 links, 256 runs
    if not args.load_only:
        asyncio.run(history())
    if not args.history_only:
        asyncio.run(load(args))


if __name__ == "__main__":
    if not Path(SSHD_BIN).exists():
        print(f"cannot run here: no OpenSSH server at {SSHD_BIN}")
        sys.exit(SKIP_EXIT)
    main()
