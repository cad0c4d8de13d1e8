"""Benchmark: the job's time taking a drain's results in (checks reported, layer statistics, manifest saved).

This ran between two batches while the GPU waited (`completed.results_seconds`; figures in
docs/benchmarks.md), so it counted in the end-to-end overhead; it now runs beside the next batch
(agent/extract/engine/results_lane.py), and its cost is the CPU it takes from the driver's process.
Results like the H200 run's (4 captured layers, per-layer sums), in drains of 64, into a real output
directory; the milestone lines go to /dev/null.
Run: .venv/bin/python tests/bench/bench_results.py [--samples 512] [--repeat 3]; EAGLEWATCH_BENCH_QUICK=1
takes 128 samples. Prints BENCH lines for run_all.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.extract.capture.stats import RunStats
from agent.extract.engine.driver import Progress, handle_results
from agent.extract.writing.writer import Manifest
from tests.bench.run_all import bench_line

LAYERS = [2, 16, 29, 32]
DRAIN = 64


class _Spec:
    on_shape_failure = "warn"

    def __init__(self, out: str) -> None:
        self.output_dir = out


class _Plan:
    layer_ids = LAYERS

    def __init__(self, out: str) -> None:
        self.spec = _Spec(out)


def _results(first: int, n: int) -> list[dict[str, Any]]:
    sums = {"sumsq": 4096.0, "max_abs": 0.5, "zeros": 0.0, "non_finite": 0.0, "n": 4.2e6, "finite_n": 4.2e6}
    return [
        {
            "idx": i,
            "file": f"hs_{i}.safetensors",
            "tokens": 1024,
            "bytes": 33_554_432,
            "written": True,
            "problems": [],
            "layer_stats": [dict(sums) for _ in LAYERS],
        }
        for i in range(first, first + n)
    ]


def one_run(samples: int) -> float:
    """Seconds to take `samples` results in, in drains of 64."""
    with tempfile.TemporaryDirectory() as out:
        manifest = Manifest("m", LAYERS, "input", 4096, "bfloat16", "worker-extension", ["x"], samples)
        prog = Progress(total=samples, stats=RunStats(LAYERS))
        drains = [_results(i, min(DRAIN, samples - i)) for i in range(0, samples, DRAIN)]
        plan: Any = _Plan(out)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            t0 = time.perf_counter()
            for batch in drains:
                handle_results(batch, plan, manifest, prog)
            return time.perf_counter() - t0


def main() -> None:
    """Best of --repeat runs; µs per result and ms per 512."""
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=128 if quick else 512)
    parser.add_argument("--repeat", type=int, default=1 if quick else 3)
    args = parser.parse_args()
    best = min(one_run(args.samples) for _ in range(args.repeat))
    per = 1e6 * best / args.samples
    print(f"{args.samples} results in drains of {DRAIN}: {1000 * best:.1f} ms (best of {args.repeat})")
    bench_line("results", "us per result taken in", round(per, 1), "us", samples=args.samples)


if __name__ == "__main__":
    main()
