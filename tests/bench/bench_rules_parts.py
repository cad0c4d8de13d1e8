"""Where the per-line time of MilestoneEngine.feed goes, on the steady-state lines of a synthetic log, and
what a classified line (one the prefilter lets through: throughput lines, EAGLEWATCH markers) costs on the
full path (``feed``: parse, search the candidate rules) and on the bulk path (``feed_many``: shape plans).

``EAGLEWATCH_BENCH_QUICK=1`` uses 50000 lines instead of 200000. Prints BENCH lines for ``run_all.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.milestones.engine import MilestoneEngine, load_rules
from tests.bench.run_all import bench_line
from tests.helpers.vllm_log import steady_lines


def per_line(label: str, fn: object, lines: list[str]) -> None:
    """Print CPU µs per line of ``fn`` over ``lines`` (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        fn(lines)  # type: ignore[operator]
        best = min(best, time.process_time() - t0)
    print(f"{label:<28} {best / len(lines) * 1e6:6.3f} us/line")
    bench_line("rules_parts", label, round(best / len(lines) * 1e6, 4), "us/line", note="CPU, best of 3")


def main() -> int:
    """Run the breakdown."""
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    lines = steady_lines(50_000 if quick else 200_000)
    eng = MilestoneEngine(load_rules())
    words = eng._gate_words

    def loop(ls: list[str]) -> None:
        for _ in ls:
            pass

    def split(ls: list[str]) -> None:
        for t in ls:
            t.split()

    def disjoint(ls: list[str]) -> None:
        for t in ls:
            words.isdisjoint(t.split())

    def feed(ls: list[str]) -> None:
        f = eng.feed
        for i, t in enumerate(ls, 1):
            f(t, i)

    per_line("empty loop", loop, lines)
    per_line("str.split", split, lines)
    per_line("split + isdisjoint", disjoint, lines)
    per_line("MilestoneEngine.feed", feed, lines)
    classified = [lines[i] for i in eng._prefilter.hits(lines)]
    rules = load_rules(backend="worker-extension")

    fresh = [MilestoneEngine(rules) for _ in range(12)]  # made before the clock starts: one per timed run

    def classified_full(ls: list[str]) -> None:
        f = fresh.pop().feed
        for i, t in enumerate(ls, 1):
            f(t, i)

    def classified_planned(ls: list[str]) -> None:
        fresh.pop().feed_many(ls, 1)

    for name, select in (("throughput", "throughput:"), ("marker", "EAGLEWATCH")):
        chosen = [t for t in classified if select in t]
        per_line(f"classified {name}, feed", classified_full, chosen)
        per_line(f"classified {name}, plan", classified_planned, chosen)
    print(f"classified lines: {len(classified)} of {len(lines)}")
    print(f"avg line length {sum(map(len, lines)) / len(lines):.0f} chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
