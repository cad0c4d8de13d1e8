"""Per-layer statistics: token sums on the tensor, assembly in the sink, run totals and collapse rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from agent.extract.capture.assembly import CaptureSink, SinkConfig, Span
from agent.extract.capture.checks import ZERO_LAYER_FROM, ZERO_LAYER_SLOT, apply_fault
from agent.extract.capture.stats import (
    BASELINE_FILES,
    RunStats,
    append_files,
    baseline_means,
    file_stats,
    fused_step_stats,
    judge,
    step_stats,
    summary,
    token_stats,
    warm,
    warm_sizes,
)

L, H = 3, 8


def _states(t: int, seed: int) -> torch.Tensor:
    return torch.randn((t, L, H), generator=torch.Generator().manual_seed(seed))


def _direct(hidden: torch.Tensor) -> list[dict[str, float | int]]:
    """The values computed the slow, obvious way over the whole sample, per layer slot."""
    out: list[dict[str, float | int]] = []
    for slot in range(hidden.shape[1]):
        x = hidden[:, slot].reshape(-1)
        rows_ok = torch.isfinite(hidden[:, slot]).all(dim=1)  # a row with a NaN/Inf leaves RMS and max
        finite = hidden[rows_ok, slot].reshape(-1)
        out.append(
            {
                "rms": math.sqrt(float((finite.double() ** 2).mean())) if finite.numel() else 0.0,
                "max_abs": float(finite.abs().max()) if finite.numel() else 0.0,
                "zero_fraction": float((x == 0).double().mean()),
                "non_finite": int((~torch.isfinite(x)).sum()),
            }
        )
    return out


def _close(got: list[dict[str, float | int]], want: list[dict[str, float | int]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["non_finite"] == w["non_finite"]
        for key in ("rms", "max_abs", "zero_fraction"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key


def test_token_stats_match_the_obvious_computation() -> None:
    hidden = _states(6, 1)
    hidden[2, 1, 3] = float("nan")
    hidden[4, 1, 0] = float("inf")
    hidden[:, 2, :4] = 0
    ts = token_stats(hidden)
    assert ts.shape == (6, L, 4) and ts.dtype == torch.float32
    _close([summary(s) for s in file_stats(ts, H)], _direct(hidden))


def test_bf16_states_are_summed_in_float32() -> None:
    hidden = (_states(64, 2) * 100).bfloat16()
    _close([summary(s) for s in file_stats(token_stats(hidden), H)], _direct(hidden.float()))


def test_stats_survive_chunked_assembly(tmp_path: Path) -> None:
    """A sample split over two steps (chunked prefill) gets the stats of the whole sample."""
    sink = CaptureSink(SinkConfig(str(tmp_path), L, H))
    a, b = _states(10, 3), _states(4, 4)
    sink.register("ra", 0, list(range(10)))
    sink.register("rb", 1, list(range(4)))
    sink.submit(torch.cat([b, a[:6]]), [Span("rb", 0, 0, 4), Span("ra", 4, 0, 6)])
    sink.submit(a[6:], [Span("ra", 0, 6, 4)])
    results = {r["idx"]: r for r in sink.drain()}
    sink.close()
    _close([summary(s) for s in results[0]["layer_stats"]], _direct(a))
    _close([summary(s) for s in results[1]["layer_stats"]], _direct(b))


def test_zero_layer_fault_and_a_dropped_layer_has_no_stats(tmp_path: Path) -> None:
    sink = CaptureSink(SinkConfig(str(tmp_path), L, H, fault="zero_layer"))
    for idx in (ZERO_LAYER_FROM - 1, ZERO_LAYER_FROM):
        sink.register(f"r{idx}", idx, [1, 2, 3])
        sink.submit(_states(3, idx), [Span(f"r{idx}", 0, 0, 3)])
    results = {r["idx"]: r for r in sink.drain()}
    sink.close()
    before, after = (results[i]["layer_stats"] for i in (ZERO_LAYER_FROM - 1, ZERO_LAYER_FROM))
    assert summary(before[ZERO_LAYER_SLOT])["rms"] > 0
    assert summary(after[ZERO_LAYER_SLOT]) == {
        "rms": 0.0,
        "max_abs": 0.0,
        "zero_fraction": 1.0,
        "non_finite": 0,
    }
    assert summary(after[0])["rms"] > 0  # only the one slot
    assert apply_fault(_states(2, 1), "zero_layer", idx=0).abs().sum() > 0
    dropped = CaptureSink(SinkConfig(str(tmp_path / "d"), L, H, fault="drop_layer"))
    (tmp_path / "d").mkdir()
    dropped.register("r", 0, [1, 2])
    dropped.submit(_states(2, 5), [Span("r", 0, 0, 2)])
    (res,) = dropped.drain()
    dropped.close()
    assert res["layer_stats"] is None  # two slots cannot be named by three layer ids


def _file(rms: float, zero_fraction: float = 0.0, n: float = 100.0) -> dict[str, float]:
    return {"sumsq": rms * rms * n, "max_abs": 3 * rms, "zeros": zero_fraction * n, "non_finite": 0.0, "n": n,
            "finite_n": n}  # fmt: skip


@pytest.mark.parametrize(
    ("rms", "zero_fraction", "want"),
    [
        (1.0, 0.0, []),
        (0.5, 0.5, []),
        (0.1, 0.0, ["collapse"]),  # 10× below the baseline
        (0.0, 1.0, ["collapse"]),  # went to 0
        (1.0, 0.95, ["collapse"]),  # RMS held up by a few values, but 95 % zeros: non-zero fraction 20× down
        (10.0, 0.0, ["explode"]),
        (float("inf"), 0.0, ["explode"]),
    ],
)
def test_judge(rms: float, zero_fraction: float, want: list[str]) -> None:
    base = [summary(_file(1.0)), summary(_file(1.2)), summary(_file(0.8))]
    got = judge({"rms": rms, "zero_fraction": zero_fraction}, baseline_means(base))
    assert [what for what, _ in got] == want


def test_run_stats_totals_baseline_and_findings_once(tmp_path: Path) -> None:
    run = RunStats([2, 4])
    for _ in range(3):  # the baseline files
        assert run.add([_file(1.0), _file(2.0)]) == []
    assert run.take_recent() == {"2": 1.0, "4": 2.0}
    found = run.add([_file(1.0), _file(0.0, zero_fraction=1.0)])
    assert [(f["layer"], f["what"]) for f in found] == [(4, "collapse")]
    assert "layer 4: RMS fell to 0 from 2" in found[0]["message"]
    assert run.add([_file(1.0), _file(0.0, zero_fraction=1.0)]) == []  # said once
    assert run.take_recent() == {"2": 1.0, "4": 0.0}
    manifest = run.to_manifest()
    assert manifest["2"]["rms"] == pytest.approx(1.0) and manifest["2"]["zero_fraction"] == 0
    assert manifest["2"]["values"] == 500
    assert manifest["4"]["rms"] == pytest.approx(math.sqrt(12 / 5)) and manifest["4"]["zero_fraction"] == 0.4
    append_files(tmp_path, [2, 4], [(7, [_file(1.0), _file(0.5)])])
    (line,) = (tmp_path / "layer_stats.jsonl").read_text().splitlines()
    doc = json.loads(line)
    assert doc["idx"] == 7 and doc["layers"]["4"]["rms"] == pytest.approx(0.5)
    # a drain's files go in one append, in order, each line the same as alone
    append_files(tmp_path, [2, 4], [(8, [_file(1.0), _file(0.5)]), (9, [_file(2.0), _file(0.0)])])
    lines = (tmp_path / "layer_stats.jsonl").read_text().splitlines()
    assert [json.loads(x)["idx"] for x in lines] == [7, 8, 9]
    assert json.loads(lines[1])["layers"] == doc["layers"]
    assert json.loads(lines[2])["layers"]["2"]["rms"] == pytest.approx(2.0)
    append_files(tmp_path, [2, 4], [])  # nothing drained: nothing written
    assert len((tmp_path / "layer_stats.jsonl").read_text().splitlines()) == 3


def test_baseline_means_are_fixed_once_the_baseline_is_in() -> None:
    run = RunStats([2])
    for _ in range(BASELINE_FILES):
        run.add([_file(2.0)])
    assert run.means == {2: (pytest.approx(2.0), 1.0)}
    found = run.add([_file(0.1)])
    assert [f["what"] for f in found] == ["collapse"] and "from 2" in found[0]["message"]


def test_flags_from_stats_equal_token_flags() -> None:
    import torch

    from agent.extract.capture.checks import token_flags
    from agent.extract.capture.stats import flags_from_stats, token_stats

    x = torch.randn(6, 3, 8)
    x[1] = 0.0  # all zero: flagged zero
    x[2, 1, 3] = float("nan")  # one NaN: not finite, yet non-zero
    x[3, 2, 0] = float("inf")
    x[4, 0] = 0.0  # one layer zero: the token is still non-zero
    x[5, :, :7] = 0.0  # one value left per layer
    for dtype in (torch.float32, torch.bfloat16):
        h = x.to(dtype)
        assert torch.equal(flags_from_stats(token_stats(h), 8), token_flags(h))
    assert flags_from_stats(token_stats(x), 8).tolist() == [
        [True, True],
        [True, False],
        [False, True],
        [False, True],
        [True, True],
        [True, True],
    ]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_fused_statistics_equal_eager_ones_for_every_step_size() -> None:
    """The compiled statistics a CUDA worker runs (compiled here for the CPU with force=True: the same
    torch.compile of the same function) give the eager values at token counts other than the warm-up's,
    zeros, Inf and NaN rows included."""
    torch.manual_seed(0)
    fn, how = fused_step_stats(torch.randn(16, 3, 64, dtype=torch.bfloat16), force=True)
    assert how == "compiled"
    for t in (5, 16, 333):
        rows = torch.randn(t, 3, 64, dtype=torch.bfloat16)
        rows[1, 2] = 0
        rows[2, 0, 5] = float("inf")
        rows[3, 1, 7] = float("nan")
        (got, got_flags), (want, want_flags) = fn(rows), step_stats(rows)
        assert got.shape == (t, 3, 4)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
        assert torch.equal(got_flags, want_flags)
        assert not bool(got_flags[2, 0]) and not bool(got_flags[3, 0]) and bool(got_flags[0, 0])


def test_the_statistics_stay_eager_off_cuda() -> None:
    """Without CUDA (the CPU engine) nothing is compiled, and the reason is given."""
    fn, how = fused_step_stats(torch.zeros(2, 2, 2))
    assert fn is step_stats
    assert how == "eager: cpu device"


def test_warm_sizes_cover_the_largest_step_and_the_specialisations() -> None:
    assert warm_sizes(16384) == [16384, 16383, 1]
    assert warm_sizes(1000) == [1000, 992, 1]
    assert warm_sizes(1) == [1]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_warm_runs_the_compiled_statistics_once_per_size_before_any_step() -> None:
    """After warm() the compiled function meets those sizes without compiling again (compiled for the CPU
    with force=True)."""
    import torch._dynamo.utils as dynamo_utils

    fn, how = fused_step_stats(torch.randn(16, 2, 32), force=True)
    assert how == "compiled"
    took = warm(fn, torch.randn(16, 2, 32), warm_sizes(100))
    assert sorted(took) == [1, 96, 100] and all(ms >= 0 for ms in took.values())
    before = dict(dynamo_utils.counters["stats"])
    assert before.get("unique_graphs", 0) >= 1  # the counter that would grow with a recompile
    with torch.inference_mode():  # as vLLM runs its steps
        for n in (100, 96, 1):
            fn(torch.randn(n, 2, 32))
    assert dict(dynamo_utils.counters["stats"]).get("unique_graphs") == before.get("unique_graphs")
