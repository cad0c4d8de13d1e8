"""CaptureCosts: totals from several threads and the per-step means the completed milestone carries."""

from __future__ import annotations

import threading

from agent.extract.costs import CaptureCosts


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
            costs.add(write_s=0.001, files=1)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(4):
        costs.add(steps=1, forward_thread_s=0.002, buffer_wait_s=0.0005)
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
