"""Run every benchmark in tests/bench/ and print a table of measured figures beside their goals.

Usage: ``python tests/bench/run_all.py [--only NAME ...] [--timeout S] [--json FILE] [--strict]``

Convention for a benchmark ``tests/bench/bench_*.py`` (each also runs alone as
``python tests/bench/bench_x.py``): print whatever helps a reader, and for every figure one line

    BENCH {"name": "ingest", "metric": "lines/s", "value": 251000.0, "unit": "lines/s",
           "goal": ">= 200000", "ok": true}

``name`` names the benchmark (file), ``metric`` the figure, ``value`` a number, ``unit`` its unit, ``goal``
a string ``"<op> <number>"`` (op one of >=, <=, >, <) or null when there is none, ``ok`` the bench's own
verdict (bool, or null without a goal; when left out, run_all works it out from ``goal``). Optional:
``baseline`` (the same figure for the thing compared against, e.g. raw ``ssh tail -F``) and ``note``.
``bench_line(...)`` below prints such a line (``from run_all import bench_line`` in a bench). Benchmarks
should honour ``EAGLEWATCH_BENCH_QUICK=1`` (set by ``--quick``) by shrinking their inputs. A benchmark that
cannot run on this machine (no GPU, say) prints why and exits with ``SKIP_EXIT`` (77): shown, not a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PREFIX = "BENCH "
#: Exit status of a benchmark that cannot run here (the automake convention).
SKIP_EXIT = 77
_OPS = {
    ">=": lambda v, g: v >= g,
    "<=": lambda v, g: v <= g,
    ">": lambda v, g: v > g,
    "<": lambda v, g: v < g,
}


def bench_line(
    name: str,
    metric: str,
    value: float,
    unit: str,
    goal: str | None = None,
    ok: bool | None = None,
    **extra: Any,
) -> str:
    """Print (and return) one ``BENCH {...}`` line; ``ok`` defaults to the verdict of ``goal``."""
    record = {
        "name": name,
        "metric": metric,
        "value": value,
        "unit": unit,
        "goal": goal,
        "ok": ok if ok is not None else meets_goal(value, goal),
        **extra,
    }
    line = PREFIX + json.dumps(record)
    print(line, flush=True)
    return line


def meets_goal(value: float, goal: str | None) -> bool | None:
    """Whether value meets a goal like ``">= 200000"``; None without a goal or with one not understood."""
    if not goal:
        return None
    op, _, number = goal.strip().partition(" ")
    try:
        target = float(number.replace("_", "").replace(",", ""))
    except ValueError:
        return None
    check = _OPS.get(op)
    if check is None or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return bool(check(float(value), target))


@dataclass(frozen=True)
class BenchRun:
    """The outcome of running one benchmark file."""

    file: str
    returncode: int | None  # None: killed at the timeout
    seconds: float
    records: list[dict[str, Any]]
    bad_lines: list[str]


def parse_records(stdout: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The BENCH records in a benchmark's output, and BENCH lines that could not be read."""
    records: list[dict[str, Any]] = []
    bad: list[str] = []
    for line in stdout.splitlines():
        if not line.startswith(PREFIX):
            continue
        try:
            record = json.loads(line[len(PREFIX) :])
        except json.JSONDecodeError:
            bad.append(line)
            continue
        if not isinstance(record, dict) or not {"name", "metric", "value"} <= set(record):
            bad.append(line)
            continue
        if record.get("ok") is None:
            record["ok"] = meets_goal(record["value"], record.get("goal"))
        records.append(record)
    return records, bad


def run_one(path: Path, timeout_s: float, env: dict[str, str]) -> BenchRun:
    """Run one benchmark file, echoing its output, and collect its BENCH lines."""
    print(f"\n=== {path.name}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the bench's own children (daemons, servers) go with it
        out, _ = proc.communicate()
        code = None
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    records, bad = parse_records(out)
    return BenchRun(path.name, code, time.monotonic() - started, records, bad)


def fmt(value: Any) -> str:
    """A number for the table: thousands grouped, at most 4 significant decimals."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def table(runs: list[BenchRun]) -> str:
    """The summary table: one row per figure, plus a row for a bench that failed or printed none."""
    rows = [("bench", "metric", "measured", "goal", "baseline", "ok")]
    for run in runs:
        for r in run.records:
            verdict = {True: "yes", False: "NO", None: "-"}[r.get("ok")]
            unit = r.get("unit") or ""
            baseline = r.get("baseline")
            rows.append(
                (
                    r["name"],
                    r["metric"],
                    f"{fmt(r['value'])} {unit}".strip(),
                    r.get("goal") or "-",
                    "-" if baseline is None else fmt(baseline),
                    verdict,
                )
            )
        if run.returncode == SKIP_EXIT:
            rows.append((run.file, "(run)", "skipped: cannot run here", "-", "-", "-"))
        elif run.returncode != 0 or not run.records:
            why = "timed out" if run.returncode is None else f"exit {run.returncode}"
            rows.append((run.file, "(run)", why if run.returncode != 0 else "no BENCH lines", "-", "-", "NO"))
        for line in run.bad_lines:
            rows.append((run.file, "(bad BENCH line)", line[:40], "-", "-", "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; exit 1 when one fails to run (or, with --strict, misses a goal)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="run only bench_NAME.py (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per benchmark")
    parser.add_argument("--json", type=Path, help="also write all records to this file")
    parser.add_argument("--quick", action="store_true", help="set EAGLEWATCH_BENCH_QUICK=1 (smaller inputs)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a figure misses its goal")
    parser.add_argument("--dir", type=Path, default=HERE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    files = sorted(args.dir.glob("bench_*.py"))
    if args.only:
        wanted = {n.removeprefix("bench_").removesuffix(".py") for n in args.only}
        files = [f for f in files if f.stem.removeprefix("bench_") in wanted]
    if not files:
        print(f"no benchmarks found in {args.dir}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.quick:
        env["EAGLEWATCH_BENCH_QUICK"] = "1"
    root = str(HERE.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, str(HERE), env.get("PYTHONPATH", "")) if p)
    runs = [run_one(f, args.timeout, env) for f in files]
    print("\n" + table(runs))
    if args.json:
        args.json.write_text(json.dumps([r for run in runs for r in run.records], indent=1))
    broken = any(
        run.returncode != SKIP_EXIT and (run.returncode != 0 or not run.records or run.bad_lines)
        for run in runs
    )
    missed = any(r.get("ok") is False for run in runs for r in run.records)
    return 1 if broken or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
