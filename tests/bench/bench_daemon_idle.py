"""Benchmark: agent daemon RSS and CPU% while idly watching 8 running jobs; log line → follower latency.

Run: .venv/bin/python tests/bench/bench_daemon_idle.py [--seconds 20]
Goals: RSS <= 30 MB, CPU <= 0.5 %; latency well under 50 ms.
``EAGLEWATCH_BENCH_QUICK=1`` shortens the idle window to 8 s. Prints BENCH lines for ``run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.run_all import bench_line
from tests.helpers.agentjobs import write_script
from tests.helpers.agentproc import AgentClient, cleanup_runs, log_lines, start_agent

CLK_TCK = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def main() -> None:
    """Run the benchmark and print the numbers against the goals."""
    ap = argparse.ArgumentParser()
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    ap.add_argument("--seconds", type=float, default=8.0 if quick else 20.0)
    ap.add_argument("--runs", type=int, default=8)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ewbench") as tmp_s:
        tmp = Path(tmp_s)
        state = tmp / "state"
        agent = start_agent(state)
        try:
            idle = write_script(tmp, "idle", "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
            with AgentClient(agent.socket) as c:
                for i in range(opts.runs):
                    c.result("launch", run=f"idle-{i}", spec={"backend": "command", "command": idle})
                time.sleep(3)  # let every watcher settle into its idle wait
                rss0, cpu0, t0 = rss_mb(agent.pid), cpu_s(agent.pid), time.monotonic()
                time.sleep(opts.seconds)
                cpu1, t1 = cpu_s(agent.pid), time.monotonic()
                rss1 = rss_mb(agent.pid)
                running = sum(r["state"] == "running" for r in c.result("list")["runs"])
            cpu_pct = 100 * (cpu1 - cpu0) / (t1 - t0)
            print(f"daemon idle, {running} running runs watched, {t1 - t0:.1f} s:")
            print(f"  RSS   {rss1:6.1f} MB (at start of window {rss0:.1f} MB)")
            print(f"  CPU   {cpu_pct:6.3f} %")
            verdict = "PASS" if rss1 <= 30 and cpu_pct <= 0.5 and running == opts.runs else "FAIL"
            print(f"  goal  idle agent watching {opts.runs} runs: RSS <= 30 MB, CPU <= 0.5 %: {verdict}")
            note = f"{running} running runs watched, {t1 - t0:.1f} s window"
            bench_line("daemon_idle", "RSS", round(rss1, 1), "MB", goal="<= 30", note=note)
            bench_line("daemon_idle", "CPU", round(cpu_pct, 3), "%", goal="<= 0.5", note=note)

            ticker = write_script(
                tmp,
                "ticker",
                """
                import time
                for i in range(40):
                    print(f"tick {time.time():.6f}", flush=True)
                    time.sleep(0.1)
            """,
            )
            lat: list[float] = []
            with AgentClient(agent.socket) as c:
                c.result("launch", run="ticker", spec={"backend": "command", "command": ticker})
                c.result("follow", run="ticker", after_seq=10**9, log_offset=0)
                first = True
                while len(lat) < 40:
                    msg = c.read_message(10)
                    now = time.time()
                    for _, text in log_lines(msg):
                        if text.startswith("tick ") and not first:
                            lat.append((now - float(text.split()[1])) * 1000)
                        elif text.startswith("tick "):
                            first = False  # the first may wait for the follow to start
                            lat.append(float("nan"))
            lat = [x for x in lat if x == x]
            lat.sort()
            print(
                f"log line -> follower latency, {len(lat)} lines: median {statistics.median(lat):.1f} ms, "
                f"p95 {lat[int(len(lat) * 0.95) - 1]:.1f} ms, max {lat[-1]:.1f} ms   goal well under 50 ms"
            )
            note = f"{len(lat)} lines; goal: well under 50 ms"
            bench_line("daemon_idle", "line->follower p50", round(statistics.median(lat), 1), "ms", note=note)
            p95 = round(lat[int(len(lat) * 0.95) - 1], 1)
            bench_line("daemon_idle", "line->follower p95", p95, "ms", note=note)
        finally:
            agent.kill()
            cleanup_runs(state)


if __name__ == "__main__":
    main()
