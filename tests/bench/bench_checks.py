"""Benchmark the daemon's capture-file checks (OutputChecks): do they keep up with the job writing them?

Run: .venv/bin/python tests/bench/bench_checks.py [--files 3000] [--big 8] [--big-mb 128]
- header checks: the check of a safetensors file from its header alone, in the daemon's process, file by
  file (goal >= 500 files/s);
- small files end to end: many small files with hidden states to scan, through the check children
  (files/s from the first look to the last result);
- deep scans: a few large files through warm children (MB/s), beside a plain read of the same files in the
  same cache state (the disk's read rate as this process sees it; goal: at least half of it).
``EAGLEWATCH_BENCH_QUICK=1`` shrinks the inputs. Prints BENCH lines for ``run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.checks.child import CheckPool, pool_size
from agent.runs.capture_checks import OutputChecks
from agent.runs.jobspec import JobSpec
from tests.bench.run_all import bench_line

L, H = 4, 256
HEADER_GOAL = 500.0


def write_safetensors(path: Path, tokens: int, hidden: int) -> None:
    """A [T] I64 + [T, L, hidden] BF16 file of ones."""
    ids = struct.pack(f"<{tokens}q", *range(tokens))
    hs = struct.pack("<H", 0x3F80) * (tokens * L * hidden)
    header = {
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [0, len(ids)]},
        "hidden_states": {
            "dtype": "BF16",
            "shape": [tokens, L, hidden],
            "data_offsets": [len(ids), len(ids) + len(hs)],
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + ids + hs)


async def check_all(out: Path, hidden: int) -> tuple[float, int]:
    """Seconds for OutputChecks to check every file of ``out`` (as at a job's end), and events recorded."""
    events: list[dict[str, Any]] = []
    spec = JobSpec.stored({"output_dir": str(out), "expect": {"layers": L, "hidden_size": hidden}})
    checks = OutputChecks(spec, {}, set(), events.extend, lambda: 0, lambda _r: None, lambda: None)
    t0 = time.perf_counter()
    await checks.scan(final=True)
    await checks.drain()
    took = time.perf_counter() - t0
    await checks.close()
    return took, sum(e["type"] == "check" for e in events)


def read_rate(out: Path) -> float:
    """MB/s of reading every file of ``out`` once, 16 MiB at a time."""
    total, t0 = 0, time.perf_counter()
    for p in out.iterdir():
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                total += len(chunk)
    return total / 1e6 / (time.perf_counter() - t0)


def bench_header(tmp: Path, n: int) -> None:
    """check_path(deep=False) file by file: the daemon's own check of a file whose header is all it reads."""
    from agent.checks.checker import Expectation, check_path

    out = tmp / "header"
    out.mkdir()
    paths = [out / f"hs_{i}.safetensors" for i in range(n)]
    for p in paths:
        write_safetensors(p, 16, H)
    expect = Expectation(layers=L, hidden_size=H)
    t0 = time.perf_counter()
    assert all(check_path(p, expect, deep=False).ok for p in paths)
    rate = n / (time.perf_counter() - t0)
    print(f"header checks in the daemon's process: {rate:.0f} files/s ({n} files)")
    bench_line("checks", "header files/s", round(rate), "files/s", goal=f">= {HEADER_GOAL:.0f}")


def bench_small(tmp: Path, n: int) -> None:
    out = tmp / "small"
    out.mkdir()
    for i in range(n):
        write_safetensors(out / f"hs_{i}.safetensors", 16, H)
    took, got = asyncio.run(check_all(out, H))
    assert got == n, got
    rate = n / took
    print(f"small files through {pool_size()} check child(ren): {n} in {took:.2f} s = {rate:.0f} files/s")
    bench_line("checks", "small deep files/s", round(rate), "files/s", note=f"{n} files of [16, {L}, {H}]")


async def scan_with_pool(paths: list[Path], hidden: int) -> float:
    """Seconds for a warm CheckPool (children started, numpy imported) to deep-check ``paths``, a file per
    request spread over its children as the daemon spreads batches."""
    pool = CheckPool(pool_size())
    arg = {"layers": L, "hidden_size": hidden, "deep": True}
    try:
        await asyncio.gather(*(pool.check([{**arg, "path": str(paths[0])}]) for _ in range(pool_size())))
        t0 = time.perf_counter()
        reports = await asyncio.gather(*(pool.check([{**arg, "path": str(p)}]) for p in paths))
        took = time.perf_counter() - t0
    finally:
        await pool.close()
    assert all(r[0]["ok"] for r in reports), reports
    return took


def bench_big(tmp: Path, n: int, mb: int) -> None:
    out = tmp / "big"
    out.mkdir()
    tokens = mb * 2**20 // (L * 7168 * 2)
    paths = [out / f"hs_{i}.safetensors" for i in range(n)]
    for p in paths:
        write_safetensors(p, tokens, 7168)
    size = sum(p.stat().st_size for p in paths) / 1e6
    disk = read_rate(out)
    took = asyncio.run(scan_with_pool(paths, 7168))
    rate = size / took
    print(
        f"deep scans, {pool_size()} warm child(ren): {n} files, {size:.0f} MB in {took:.2f} s "
        f"= {rate:.0f} MB/s; a plain read of the same files: {disk:.0f} MB/s"
    )
    note = f"{n} × {mb} MB BF16, {pool_size()} children, same cache state as the plain read"
    goal = f">= {disk / 2:.0f}"
    bench_line("checks", "deep MB/s", round(rate), "MB/s", goal=goal, baseline=round(disk), note=note)


def main() -> None:
    """Run the three benchmarks and print the numbers."""
    quick = os.environ.get("EAGLEWATCH_BENCH_QUICK") == "1"
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=1000 if quick else 3000)
    ap.add_argument("--big", type=int, default=4 if quick else 8)
    ap.add_argument("--big-mb", type=int, default=64 if quick else 128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        bench_header(Path(d), args.files)
        bench_small(Path(d), args.files)
        bench_big(Path(d), args.big, args.big_mb)


if __name__ == "__main__":
    main()
