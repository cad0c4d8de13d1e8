"""CaptureCosts: totals from several threads and the per-step means the completed milestone carries."""

from __future__ import annotations

import re
import threading

import pytest

from agent.extract.capture.costs import CaptureCosts, StepCost, percentile
from agent.extract.engine.setup import Tuning, tuning_from_env


class _Timed:
    """Stands in for a CUDA timing event (no GPU here): elapsed_time is the difference of stamps in ms."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: _Timed) -> float:
        return other.ms - self.ms


def test_costs_add_up_across_threads_and_give_per_step_means() -> None:
    costs = CaptureCosts()

    def writer() -> None:
        for _ in range(1000):
            costs.add_write(0.001)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(4):
        costs.add_step(StepCost(begin_ms=0.5, launch_ms=1.0, wait_ms=0.5, end_ms=0.5))
        costs.add_step_timing((_Timed(0.0), _Timed(1.5), _Timed(2.0), _Timed(6.0)))
    costs.add_step_timing(None)  # a CPU step has no events
    for t in threads:
        t.join()
    got = costs.fields()
    assert got["files"] == 4000 and abs(got["write_s"] - 4.0) < 1e-6
    assert got["steps"] == 4 and got["forward_thread_ms_per_step"] == 2.0
    assert got["buffer_wait_s"] == 0.002
    assert got["device_ms_per_step"] == 1.5 and got["copy_ms_per_step"] == 4.0


def test_costs_of_a_run_without_steps_are_zero_not_an_error() -> None:
    got = CaptureCosts().fields()
    assert got["steps"] == 0 and got["forward_thread_ms_per_step"] == 0.0 and got["device_ms_per_step"] == 0.0


def test_step_costs_give_the_split_the_spread_and_a_trace() -> None:
    costs = CaptureCosts()
    for i in range(10):
        step = StepCost(begin_ms=0.5, launch_ms=1.0 + i, wait_ms=2.0 if i == 9 else 0.0, end_ms=0.25)
        step.gpu_idle, step.tokens = i % 2 == 0, 100
        costs.add_step(step)
        costs.add_step_timing((_Timed(0.0), _Timed(1.0 + i), _Timed(2.0), _Timed(4.0)))
        costs.add_held(10.0 * (i + 1))
    got = costs.fields()
    assert got["steps"] == 10 and got["begin_ms_per_step"] == 0.5 and got["end_ms_per_step"] == 0.25
    assert got["launch_ms_per_step"] == 5.5 and got["forward_thread_ms_per_step"] == 6.25
    assert got["forward_thread_ms_p50"] in (5.75, 6.75) and got["forward_thread_ms_max"] == 10.75
    assert got["buffer_wait_steps"] == 1 and got["buffer_wait_s"] == 0.002
    assert got["gpu_idle_launches"] == 5 and got["buffer_held_ms_max"] == 100.0
    rows = costs.trace()
    assert len(rows) == 10 and rows[0]["t_s"] == 0.0 and rows[-1]["wait_ms"] == 2.0
    assert rows[3]["device_ms"] == 4.0 and rows[3]["copy_ms"] == 2.0 and rows[3]["held_ms"] == 40.0


def test_percentile_by_nearest_rank() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([3.0, 1.0, 2.0], 1.0) == 3.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"EAGLEWATCH_WRITERS": "x"}, "EAGLEWATCH_WRITERS='x': expected a number"),
        ({"EAGLEWATCH_PINNED_BUFFERS": "1"}, "EAGLEWATCH_PINNED_BUFFERS='1': expected a number from 2 to 64"),
        (
            {"EAGLEWATCH_PINNED_BUFFERS": "nan"},
            "EAGLEWATCH_PINNED_BUFFERS='nan': expected a number from 2 to 64",
        ),
        ({"EAGLEWATCH_WRITERS": "2.5"}, "EAGLEWATCH_WRITERS='2.5': expected a whole number"),
        ({"EAGLEWATCH_WRITEBACK_MB": "-1"}, "EAGLEWATCH_WRITEBACK_MB='-1': expected a number from 0 to"),
        ({"EAGLEWATCH_WRITEBACK_MB": "0.5"}, "EAGLEWATCH_WRITEBACK_MB='0.5': expected a whole number"),
    ],
)
def test_malformed_tuning_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        tuning_from_env(env)


def test_tuning_defaults_and_values() -> None:
    assert tuning_from_env({}) == Tuning(pinned_buffers=6, writers=4, writeback_mb=1024, trace=None)
    got = tuning_from_env({"EAGLEWATCH_PINNED_BUFFERS": "10", "EAGLEWATCH_WRITERS": " 8 "})
    assert (got.pinned_buffers, got.writers) == (10, 8)
    assert tuning_from_env({"EAGLEWATCH_WRITEBACK_MB": "0"}).writeback_mb == 0
    assert "trace" not in got.fields()
    assert tuning_from_env({"EAGLEWATCH_COSTS_TRACE": "/t.json"}).trace == "/t.json"
