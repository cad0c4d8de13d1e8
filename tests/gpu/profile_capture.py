"""GPU phase `profile` (run on the H200, no vLLM needed): what each piece of one capture step costs.

Times, with CUDA events (median of repeats), the device work the worker extension adds to each step of an
8B-shaped prefill (T tokens x 4 layers x 4096, bf16): stacking the layers, the per-layer statistics
(`stats.token_stats`, its parts, and a fused alternative), the flags, the D2H copy into pinned memory, and
how much a side-stream copy or the statistics slow a stand-in forward (the 8B MLP's GEMMs) running beside
them. Then the disk: 64 sample files of the 8B shape written by 4 threads, as the writer does.
`python3 tests/gpu/profile_capture.py --out DIR` writes DIR/profile.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from agent.extract import stats  # noqa: E402
from agent.extract.writing.writer import write_sample  # noqa: E402

H, L = 4096, 4


def timed(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median milliseconds of fn on the current stream."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return round(statistics.median(out), 4)


def device_costs(t: int) -> dict[str, Any]:
    """Per-step device costs for t tokens."""
    dev = torch.device("cuda")
    layers = [torch.randn(t, H, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    rows = torch.stack(layers, dim=1)
    pinned = torch.empty(rows.numel() * 2, dtype=torch.uint8, pin_memory=True)
    host = pinned.view(torch.bfloat16).view(rows.shape)
    res: dict[str, Any] = {"tokens": t, "bytes": rows.numel() * 2}
    res["stack_ms"] = timed(lambda: torch.stack(layers, dim=1))
    res["token_stats_ms"] = timed(lambda: stats.token_stats(rows))
    st = stats.token_stats(rows)
    res["flags_ms"] = timed(lambda: stats.flags_from_stats(st, H))
    res["part_norm_ms"] = timed(lambda: torch.linalg.vector_norm(rows, ord=2, dim=-1, dtype=torch.float32))
    res["part_aminmax_ms"] = timed(lambda: torch.aminmax(rows, dim=-1))
    res["part_isfinite_ms"] = timed(lambda: torch.isfinite(rows).sum(dim=-1, dtype=torch.float32))
    res["part_zeros_ms"] = timed(lambda: (rows == 0).sum(dim=-1, dtype=torch.float32))
    try:
        fused = torch.compile(stats.token_stats, dynamic=True)
        t0 = time.monotonic()
        want = stats.token_stats(rows)
        got = fused(rows)
        res["compiled_first_call_s"] = round(time.monotonic() - t0, 2)
        res["compiled_token_stats_ms"] = timed(lambda: fused(rows))
        res["compiled_equal"] = bool(torch.allclose(got, want, rtol=1e-5, atol=1e-3))
    except Exception as e:  # the record says why the compiled variant is missing
        res["compiled_error"] = f"{type(e).__name__}: {e}"[:300]
    res["d2h_ms"] = timed(lambda: host.copy_(rows, non_blocking=True))
    res["d2h_gb_s"] = round(res["bytes"] / res["d2h_ms"] / 1e6, 1)
    # a stand-in forward: the 8B MLP's GEMMs over the same tokens, 8 layers' worth
    x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(H, 14336, device=dev, dtype=torch.bfloat16) * 0.01
    w2 = torch.randn(14336, H, device=dev, dtype=torch.bfloat16) * 0.01

    def forward() -> None:
        y = x
        for _ in range(8):
            y = (y @ w1) @ w2

    side = torch.cuda.Stream()

    def forward_with_copy() -> None:
        ev = torch.cuda.Event()
        ev.record()
        with torch.cuda.stream(side):
            side.wait_event(ev)
            host.copy_(rows, non_blocking=True)
        forward()
        torch.cuda.current_stream().wait_stream(side)

    def forward_with_stats() -> None:
        forward()
        st2 = stats.token_stats(torch.stack(layers, dim=1))
        stats.flags_from_stats(st2, H)

    res["forward_ms"] = timed(forward, 10)
    res["forward_with_copy_ms"] = timed(forward_with_copy, 10)
    res["forward_with_stack_stats_ms"] = timed(forward_with_stats, 10)
    return res


def host_costs(t: int, steps: int = 20) -> dict[str, Any]:
    """Host (forward thread) milliseconds per step of each capture call, the way worker_ext._ew_launch makes
    them, each right behind a stand-in forward that keeps the GPU busy; alone, and beside a thread that
    keeps taking the GIL (a writer thread's Python work)."""
    import threading

    from agent.extract.capture.gpu_copy import PinnedCopier

    dev = torch.device("cuda")
    layers = [torch.randn(t, H, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    fused, how = stats.fused_step_stats(torch.randn(16, L, H, device=dev, dtype=torch.bfloat16))
    copier = PinnedCopier(dev)
    copier.reserve(t * L * H * 2 + t * (2 + 16 * L) + 192)
    x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(H, H, device=dev, dtype=torch.bfloat16) * 0.01

    def run(label: str) -> dict[str, float]:
        parts: dict[str, list[float]] = {"stack": [], "stats": [], "copy": [], "total": []}
        for i in range(steps + 3):
            y = x
            for _ in range(40):  # ~40 ms of GPU work queued ahead, as a forward would be
                y = y @ w
            t0 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            rows = torch.stack(layers, dim=1)
            t1 = time.perf_counter()
            st, flags = fused(rows)
            t2 = time.perf_counter()
            _, done, release, _ = copier.copy_async(rows, flags, st)
            t3 = time.perf_counter()
            done.synchronize()
            release()
            if i >= 3:
                for k, v in (("stack", t1 - t0), ("stats", t2 - t1), ("copy", t3 - t2), ("total", t3 - t0)):
                    parts[k].append(1000 * v)
        return {f"{label}_{k}_ms": round(statistics.median(v), 3) for k, v in parts.items()}

    res: dict[str, Any] = {"tokens": t, "stats_kernel": how, **run("alone")}
    stop = threading.Event()

    def busy() -> None:  # Python work between short sleeps, like a writer between its syscalls
        while not stop.is_set():
            sum(range(20000))
            time.sleep(0.0005)

    th = threading.Thread(target=busy, daemon=True)
    th.start()
    res.update(run("gil"))
    stop.set()
    th.join()
    return res


def disk(work: Path, files: int = 64, writers: int = 4) -> dict[str, Any]:
    """Write `files` 8B-shaped samples (1024 tokens) with `writers` threads, like the writer pool."""
    out = work / "disk"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    hidden = torch.randn(1024, L, H).to(torch.bfloat16)
    ids = torch.arange(1024)
    t0 = time.monotonic()
    with ThreadPoolExecutor(writers) as pool:
        sizes = list(pool.map(lambda i: write_sample(out, i, ids, hidden)[1], range(files)))
    secs = time.monotonic() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {
        "files": files,
        "writers": writers,
        "gb": round(sum(sizes) / 1e9, 2),
        "gb_s": round(sum(sizes) / secs / 1e9, 2),
    }


def main() -> int:
    """Measure; write OUT/profile.json."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/ew-gpu"))
    p.add_argument("--host-only", action="store_true", help="only the forward thread's host costs")
    args = p.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["host"] = [host_costs(16384)]
    print(json.dumps(res["host"], indent=1), flush=True)
    if args.host_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile-host.json").write_text(json.dumps(res, indent=1) + "\n")
        return 0
    res["steps"] = [device_costs(t) for t in (8192, 16384)]
    print(json.dumps(res["steps"], indent=1), flush=True)
    res["disk"] = [disk(args.work, 64, w) for w in (4, 8)] + [disk(args.work, 256, 4)]
    print(json.dumps(res["disk"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
