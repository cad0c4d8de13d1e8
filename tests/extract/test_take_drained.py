"""Taking one drain's results in, without an engine: batches completed, progress lines, per-layer RMS."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from agent.extract.capture.stats import RunStats
from agent.extract.engine.driver import Progress, take_drained
from agent.extract.planning.dataset import Sample
from agent.extract.planning.preflight import Plan
from agent.extract.signals import PREFIX
from agent.extract.writing.writer import Manifest
from agent.spec import parse_spec

LAYERS = [2, 4]


def _plan(out: Path) -> Plan:
    spec = parse_spec(
        {"name": "t", "host": "h", "model": "/m", "dataset": "/d.jsonl", "output_dir": str(out)}
    )
    return Plan(spec, Path("/m"), 4, 8, "float32", LAYERS, "0.0")


def _result(idx: int, rms: float) -> dict[str, Any]:
    one = {"sumsq": rms * rms * 8, "max_abs": rms, "zeros": 0.0, "non_finite": 0.0, "n": 8.0, "finite_n": 8.0}
    return {
        "idx": idx,
        "file": f"hs_{idx}.safetensors",
        "tokens": 3,
        "bytes": 100,
        "written": True,
        "problems": [],
        "layer_stats": [dict(one) for _ in LAYERS],
    }


def _take(drained: dict[str, Any], plan: Plan, manifest: Manifest, prog: Progress, batches: Any) -> list[Any]:
    """take_drained's milestone lines, decoded (batches: collect's outstanding, seen, wait)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        take_drained(drained, plan, manifest, prog, batches)
    return [
        json.loads(ln.removeprefix(PREFIX)) for ln in out.getvalue().splitlines() if ln.startswith(PREFIX)
    ]


def test_a_drain_that_completes_two_batches_reports_one_progress_line_with_their_rms(tmp_path: Path) -> None:
    """The last two batches often come back in the final drain (the writer lagged): each gets its
    batch_captured, and the one progress line after them carries both batches' RMS (a line each would
    leave the second with the counts repeated and no RMS)."""
    plan = _plan(tmp_path)
    manifest = Manifest("m", LAYERS, "input", 8, "float32", "worker-extension", ["x"], 3)
    prog = Progress(total=3, out_dir=str(tmp_path), stats=RunStats(LAYERS))
    outstanding = [[Sample(0, (1, 2, 3)), Sample(1, (1, 2, 3))], [Sample(2, (1, 2, 3))]]
    drained = {"results": [_result(0, 1.0), _result(1, 1.0), _result(2, 1.0)]}
    lines = _take(drained, plan, manifest, prog, (outstanding, set(), True))
    kinds = [ln["kind"] for ln in lines]
    assert kinds == ["shape_check_passed"] * 3 + ["batch_captured", "batch_captured", "progress"]
    batches = [(ln["batch"], ln["samples"], ln["tokens"]) for ln in lines if ln["kind"] == "batch_captured"]
    assert batches == [(1, 2, 6), (2, 1, 3)]
    (progress,) = (ln for ln in lines if ln["kind"] == "progress")
    assert progress["samples_done"] == 3 and progress["files_written"] == 3
    assert progress["layer_rms"] == {"2": 1.0, "4": 1.0}
    assert outstanding == []


def test_a_drain_that_completes_no_batch_reports_no_progress_line(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    manifest = Manifest("m", LAYERS, "input", 8, "float32", "worker-extension", ["x"], 2)
    prog = Progress(total=2, out_dir=str(tmp_path), stats=RunStats(LAYERS))
    outstanding = [[Sample(0, (1, 2, 3)), Sample(1, (1, 2, 3))]]
    batches = (outstanding, set[int](), False)
    lines = _take({"results": [_result(0, 2.0)]}, plan, manifest, prog, batches)
    assert [ln["kind"] for ln in lines] == ["shape_check_passed"]
    lines = _take({"results": [_result(1, 2.0)]}, plan, manifest, prog, batches)
    assert [ln["kind"] for ln in lines] == ["shape_check_passed", "batch_captured", "progress"]
    assert lines[-1]["layer_rms"] == {"2": 2.0, "4": 2.0}  # the RMS of both samples, taken in two drains
