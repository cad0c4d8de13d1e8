"""Canary re-capture without an engine: the pure comparison, and the sink comparing a capture made alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.extract.capture.assembly import CaptureSink, SinkConfig, Span
from agent.extract.capture.checks import BATCH_SKEW
from agent.extract.engine import canary
from agent.extract.engine.canary import TOLERANCE, pick, rel_diff, tolerance, verdict

L, H = 3, 8


def _states(t: int, seed: int) -> torch.Tensor:
    return torch.randn((t, L, H), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("n", "k", "want"),
    [(5, 2, [0, 4]), (5, 3, [0, 2, 4]), (2, 2, [0, 1]), (3, 5, [0, 1, 2]), (4, 1, [0]), (4, 0, [])],
)
def test_pick_spreads_over_the_batch(n: int, k: int, want: list[int]) -> None:
    assert pick(list(range(n)), k) == want


def test_rel_diff() -> None:
    a = _states(5, 1)
    assert rel_diff(a, a.clone()) == 0.0
    skewed = a.clone()
    skewed[:, 2] *= 1.5  # one layer off by half: the max over layers says so
    assert rel_diff(skewed, a) == pytest.approx(0.5, rel=1e-5)
    assert rel_diff(a[:, :2], a) is None  # shapes differ: not comparable (the shape check says why)
    nan = a.clone()
    nan[0, 0, 0] = float("nan")
    assert rel_diff(nan, a) == float("inf")


def test_rel_diff_lets_a_few_flipped_tokens_pass_and_not_most() -> None:
    """A mixture-of-experts model routes a few near-tie tokens differently in another batch: those tokens
    differ by ~1 and the rest agree. Wrong states move most tokens."""
    a = _states(20, 1)
    flipped = a.clone()
    flipped[:3] = _states(3, 7)  # 15 % of the tokens routed elsewhere
    assert rel_diff(flipped, a) == 0.0
    assert verdict([rel_diff(flipped, a)], "bfloat16")["ok"]
    wrong = a.clone()
    wrong[:12] = _states(12, 7)  # 60 % of the tokens hold another request's rows
    assert rel_diff(wrong, a) > 1.0  # far above every dtype's tolerance
    assert not verdict([rel_diff(wrong, a)], "bfloat16")["ok"]


@pytest.mark.parametrize(
    ("diffs", "dtype", "ok", "worst"),
    [
        ([1e-6, 2e-6], "float32", True, 2e-6),
        ([1e-6, 0.25], "float32", False, 0.25),
        ([0.03], "torch.bfloat16", True, 0.03),
        ([0.25], "torch.bfloat16", False, 0.25),
        ([0.03], "float32", False, 0.03),
        ([None, None], "float32", True, None),  # nothing comparable: no verdict against the run
    ],
)
def test_verdict(diffs: list[float | None], dtype: str, ok: bool, worst: float | None) -> None:
    got = verdict(diffs, dtype)
    assert got["ok"] is ok and got["max_rel_diff"] == worst and got["tolerance"] == tolerance(dtype)
    assert got["samples"] == len([d for d in diffs if d is not None])


def test_tolerance_follows_the_dtype() -> None:
    assert tolerance("float32") < tolerance("float16") < tolerance("bfloat16") == TOLERANCE["bfloat16"]
    assert tolerance("float8_e4m3fn") == TOLERANCE["bfloat16"]


@pytest.mark.parametrize(("fault", "want"), [(None, 0.0), ("batch_skew", BATCH_SKEW - 1)])
def test_sink_compares_alone_with_batched_and_writes_nothing(
    tmp_path: Path, fault: str | None, want: float
) -> None:
    sink = CaptureSink(SinkConfig(str(tmp_path), L, H, fault=fault))
    a, b = _states(4, 1), _states(3, 2)
    sink.register("ra", 0, [1, 2, 3, 4])
    sink.register("rb", 1, [5, 6, 7])
    sink.submit(torch.cat([a, b]), [Span("ra", 0, 0, 4), Span("rb", 4, 0, 3)])  # batched
    assert len(sink.drain()) == 2
    written = (tmp_path / "hs_0.safetensors").read_bytes()
    sink.register("ca", 0, [1, 2, 3, 4], canary=True)
    sink.submit(a.clone(), [Span("ca", 0, 0, 4)])  # alone
    (res,) = sink.drain()
    sink.close()
    assert res["canary"] is True and res["idx"] == 0 and res["rel_diff"] == pytest.approx(want, abs=1e-6)
    assert (tmp_path / "hs_0.safetensors").read_bytes() == written  # the canary never overwrites


def test_writer_process_carries_stats_and_canaries(tmp_path: Path) -> None:
    """Layer statistics and canary comparisons come back through the writer process."""
    from agent.extract.capture.stats import file_stats, summary, token_stats
    from agent.extract.writing.writer_proc import ProcessSink

    sink = ProcessSink(SinkConfig(str(tmp_path), L, H, fault="batch_skew"), max_buffers=2)
    a, b = _states(4, 1), _states(3, 2)
    rows = torch.cat([a, b])
    sink.register("ra", 0, [1, 2, 3, 4])
    sink.register("rb", 1, [5, 6, 7])
    sink.submit(rows, [Span("ra", 0, 0, 4), Span("rb", 4, 0, 3)], stats=token_stats(rows))
    first = {r["idx"]: r for r in sink.drain()}
    # batch_skew: the files hold 1.25 × the states, and so do their statistics
    want = [summary(s) for s in file_stats(token_stats(a * BATCH_SKEW), H)]
    got = [summary(s) for s in first[0]["layer_stats"]]
    assert [g["rms"] for g in got] == pytest.approx([w["rms"] for w in want], rel=1e-5)
    sink.register("ca", 0, [1, 2, 3, 4], canary=True)
    sink.submit(a.clone(), [Span("ca", 0, 0, 4)], stats=token_stats(a))
    (res,) = sink.drain()
    sink.close()
    assert res["canary"] is True and res["rel_diff"] == pytest.approx(BATCH_SKEW - 1, abs=1e-6)


@pytest.mark.parametrize(
    ("n", "size", "want"),
    [(4, 4, None), (3, 4, None), (10, 4, [8, 9]), (9, 4, [4, 5, 6, 7]), (8, 4, [4, 5, 6, 7]), (5, 1, [3])],
)
def test_end_batch_is_the_last_batch_unless_it_was_captured_alone(
    n: int, size: int, want: list[int] | None
) -> None:
    assert canary.end_batch(list(range(n)), size) == want
