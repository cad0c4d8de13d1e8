"""Benchmark: how fast the daemon catches up on a log (tail → splitter → rules → journal → cursor).

Baseline in the same run: the pure LineSplitter + MilestoneEngine loop on the same bytes, no I/O.  The
daemon's time runs from the job's start (the launch reply: a supervisor process has started it) to the
final state reaching a follower of the run's events; the job start itself is printed apart (a fixed cost
of starting a Python process, the same for a log of any size).
Run: .venv/bin/python tests/bench/bench_daemon_ingest.py [--lines 500000]
``EAGLEWATCH_BENCH_QUICK=1`` makes the default 100000 lines. Prints BENCH lines for ``run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import MilestoneEngine, load_rules
from agent.runs.watcher import READ_CHUNK
from tests.bench.run_all import bench_line
from tests.helpers.agentproc import AgentClient, cleanup_runs, start_agent, terminal_event
from tests.helpers.vllm_log import steady_lines


def pure_rate(data: bytes) -> float:
    """Lines/s of splitter + engine alone, fed as the watcher feeds them (its read size, raw blocks)."""
    engine = MilestoneEngine(load_rules(backend="command"))  # the rules the daemon loads for this run
    splitter = LineSplitter()
    n = 0
    t0 = time.perf_counter()
    for i in range(0, len(data), READ_CHUNK):
        lines, block = splitter.feed_block(data[i : i + READ_CHUNK])
        engine.feed_many([ln.text for ln in lines], n + 1)
        n += len(lines)
        if block is not None:
            engine.feed_block(block, n + 1)
            n += len(block.shapes)
    engine.flush()
    return n / (time.perf_counter() - t0)


def main() -> None:
    """Write a steady-state vLLM log, let a daemon ingest it through a real job, print lines/s."""
    ap = argparse.ArgumentParser()
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    ap.add_argument("--lines", type=int, default=100_000 if quick else 500_000)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ewingest") as tmp_s:
        tmp = Path(tmp_s)
        big = tmp / "big.log"
        data = ("\n".join(steady_lines(opts.lines, tp=8)) + "\n").encode()
        big.write_bytes(data)
        base = pure_rate(data)
        state = tmp / "state"
        agent = start_agent(state)
        try:
            with AgentClient(agent.socket, timeout=600) as c:
                t0 = time.monotonic()
                c.result("launch", run="big", spec={"backend": "command", "command": ["cat", str(big)]})
                started = time.monotonic()  # the job runs: its supervisor (a Python process) has reported
                c.result("follow", run="big", after_seq=0)
                c.wait_for(terminal_event, timeout=600)
                done = time.monotonic()
                events = c.result("status", run="big")["last_seq"]
        finally:
            agent.kill()
            cleanup_runs(state)
    total, start, ingest = done - t0, started - t0, done - started
    rate, total_rate = opts.lines / ingest, opts.lines / total
    print(f"{opts.lines} lines, {len(data) / 1e6:.1f} MB, {events} journal events")
    print(f"  pure splitter+rules : {base:10,.0f} lines/s (baseline)")
    print(f"  daemon ingest       : {rate:10,.0f} lines/s ({ingest:.2f} s, job start to final state)")
    print(f"  daemon end to end   : {total_rate:10,.0f} lines/s ({total:.2f} s, {start:.2f} s job start)")
    print(f"  ratio daemon/pure   : {rate / base:.2f}x (incl. job start: {total_rate / base:.2f}x)")
    note = (
        f"{opts.lines} lines, wall time from the job's start (launch reply) to its final state, journal "
        f"and a follower of its events included; baseline = pure splitter+rules, no I/O; "
        f"job start {start:.2f} s (supervisor process) not counted, ratio with it {total_rate / base:.2f}"
    )
    bench_line("daemon_ingest", "end-to-end lines/s", round(rate), "lines/s", baseline=round(base), note=note)
    bench_line("daemon_ingest", "ratio daemon/pure", round(rate / base, 3), "x", goal=">= 0.9", note=note)
    with_start = round(total_rate / base, 3)
    bench_line("daemon_ingest", "ratio daemon/pure incl. job start", with_start, "x", note=note)


if __name__ == "__main__":
    main()
