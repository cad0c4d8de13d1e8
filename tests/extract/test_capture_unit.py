"""The capture path without an engine: step attribution, assembly by position, checks, faults, the writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent.extract.capture.assembly import SinkConfig, Span, spans_for_step
from agent.extract.capture.checks import check_sample
from agent.extract.writing.writer import existing_valid, sample_path, write_sample
from agent.extract.writing.writer_proc import ProcessSink

L, H = 3, 8


def test_spans_follow_batch_order_not_request_names() -> None:
    # "req_0_10" sorts before "req_0_2": attribution must follow the runner's order, not names
    order = ["req_0_2", "req_0_10", "req_1"]
    scheduled = {"req_0_10": 4, "req_0_2": 3, "req_1": 2}
    spans = spans_for_step(order, scheduled, {"req_0_2": 0, "req_0_10": 8, "req_1": 5})
    assert spans == [Span("req_0_2", 0, 0, 3), Span("req_0_10", 3, 8, 4), Span("req_1", 7, 5, 2)]


def test_spans_must_cover_every_scheduled_token() -> None:
    with pytest.raises(RuntimeError, match="covers 3 tokens but the scheduler scheduled 5"):
        spans_for_step(["a"], {"a": 3, "b": 2}, {"a": 0, "b": 0})


def _states(t: int, seed: int) -> torch.Tensor:
    return torch.randn((t, L, H), generator=torch.Generator().manual_seed(seed))


def test_chunked_and_interleaved_steps_assemble_by_position(tmp_path: Path) -> None:
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H))
    a, b, c = _states(10, 1), _states(4, 2), _states(3, 3)
    sink.register("ra", 0, list(range(10)))
    sink.register("rb", 1, list(range(100, 104)))
    sink.register("rc", 2, list(range(200, 203)))
    # step 1: b whole, a[0:6]; step 2: c whole first, then a[6:10] -- order differs between steps
    sink.submit(torch.cat([b, a[:6]]), [Span("rb", 0, 0, 4), Span("ra", 4, 0, 6)])
    sink.submit(torch.cat([c, a[6:]]), [Span("rc", 0, 0, 3), Span("ra", 3, 6, 4)])
    results = sorted(sink.drain(), key=lambda r: r["idx"])
    sink.close()
    assert [(r["idx"], r["tokens"], r["written"], r["problems"]) for r in results] == [
        (0, 10, True, []),
        (1, 4, True, []),
        (2, 3, True, []),
    ]
    for idx, want, ids in ((0, a, range(10)), (1, b, range(100, 104)), (2, c, range(200, 203))):
        got = load_file(str(sample_path(tmp_path, idx)))
        assert torch.equal(got["hidden_states"], want)
        assert got["token_ids"].tolist() == list(ids)


@pytest.mark.parametrize(
    ("fault", "code"),
    [("drop_layer", "layer_count_mismatch"), ("flatten", "hidden_dim_lost"), ("zero", "all_zero")],
)
def test_fault_alert_still_writes_the_file(tmp_path: Path, fault: str, code: str) -> None:
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H, fault=fault))
    sink.register("r", 5, [1, 2, 3, 4])
    sink.submit(_states(4, 9), [Span("r", 0, 0, 4)])
    (res,) = sink.drain()
    sink.close()
    assert res["written"] and res["file"] == "hs_5.safetensors"
    assert code in [p["code"] for p in res["problems"]]
    assert sample_path(tmp_path, 5).is_file()


def test_fault_stop_does_not_write(tmp_path: Path) -> None:
    sink = ProcessSink(SinkConfig(str(tmp_path), L, H, fault="drop_layer", stop_on_failure=True))
    sink.register("r", 0, [1, 2])
    sink.submit(_states(2, 4), [Span("r", 0, 0, 2)])
    (res,) = sink.drain()
    sink.close()
    assert not res["written"] and res["problems"][0]["code"] == "layer_count_mismatch"
    assert "final layer dropped" in res["problems"][0]["message"]
    assert not sample_path(tmp_path, 0).exists()


def test_value_checks_nan_and_token_mismatch() -> None:
    hs = _states(3, 5)
    hs[1, 0, 0] = float("nan")
    found = check_sample("hs_0.safetensors", torch.tensor([1, 2, 9]), hs, [1, 2, 3], L, H)
    codes = [f.code for f in found]
    assert codes == ["seq_len_mismatch", "non_finite"]
    assert "1 of 3 tokens" in found[1].message


def test_writer_output_is_valid_safetensors_and_resume_validation(tmp_path: Path) -> None:
    hs = _states(5, 6).to(torch.bfloat16)
    path, size = write_sample(tmp_path, 3, torch.tensor([5, 6, 7, 8, 9]), hs)
    assert size == path.stat().st_size
    got = load_file(str(path))
    assert torch.equal(got["hidden_states"], hs) and got["token_ids"].dtype == torch.int64
    assert existing_valid(tmp_path, 3, [5, 6, 7, 8, 9], L, H, "BF16")
    assert existing_valid(tmp_path, 3, [5, 6, 7, 8, 9], L, H, None)
    assert not existing_valid(tmp_path, 3, [5, 6, 7, 8, 9], L, H, "F32")  # dtype of an earlier run differs
    assert not existing_valid(tmp_path, 3, [5, 6, 7, 8, 0], L, H, "BF16")  # other prompt
    assert not existing_valid(tmp_path, 3, [5, 6, 7, 8, 9], L + 1, H, "BF16")
    assert not existing_valid(tmp_path, 4, [1], L, H, None)  # missing
    with open(path, "r+b") as fh:
        fh.truncate(size - 7)
    assert not existing_valid(tmp_path, 3, [5, 6, 7, 8, 9], L, H, "BF16")


def test_hook_plan_for_both_conventions() -> None:
    from agent.extract.capture.worker_ext import plan_hooks

    # input: pre-hook on layer k; id N (= 8) is the output of the last layer
    assert plan_hooks([2, 4, 5, 8], "input", 8) == [
        (2, "pre", 0),
        (4, "pre", 1),
        (5, "pre", 2),
        (7, "post", 3),
    ]
    assert plan_hooks([1, 7], "output", 8) == [(1, "post", 0), (7, "post", 1)]
    with pytest.raises(ValueError, match=r"out of range 0\.\.7"):
        plan_hooks([8], "output", 8)
