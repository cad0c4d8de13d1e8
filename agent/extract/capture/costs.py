"""Where the capture's time goes, per run: the forward thread's own time, device time, copies and writes.

`fields()` is what the `completed` milestone carries as `capture_costs`, so a user can tell a slow disk
from a slow device step, and a few slow steps from a steady cost.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

#: steps kept for percentiles and the trace (about two hours of 400 ms steps); later steps only add to the
#: totals. fields() sorts what is kept at every drain, so this bound is also that sort's cost (~2 ms)
MAX_STEPS = 20_000


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values by nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class StepCost:
    """One step's forward-thread costs (ms) and whether the GPU had run dry when the capture launched."""

    begin_ms: float = 0.0
    launch_ms: float = 0.0
    wait_ms: float = 0.0  # of launch_ms: waiting for a free pinned buffer
    end_ms: float = 0.0
    gpu_idle: bool | None = None  # None: not known (CPU, or no capture launched)
    tokens: int = 0
    at: float = field(default_factory=time.perf_counter)

    @property
    def total_ms(self) -> float:
        """The step's forward-thread time in the capture."""
        return self.begin_ms + self.launch_ms + self.end_ms


@dataclass
class CaptureCosts:
    """Running totals (seconds unless named _ms); thread-safe adds."""

    steps: int = 0
    forward_thread_s: float = 0.0  # in the forward thread's capture code, buffer waits included
    buffer_wait_s: float = 0.0  # of which: waiting for a free pinned buffer (backpressure)
    device_ms: float = 0.0  # the capture's kernels on the compute stream (stack, statistics, flags)
    copy_ms: float = 0.0  # device→host copies on the side stream (overlapping the next forward)
    timed_steps: int = 0
    write_s: float = 0.0  # writer threads in file writes (all threads summed)
    files: int = 0
    drain_steps_ms_max: float = 0.0  # the longest wait in a drain for submitted steps to be assembled
    drain_files_ms_max: float = 0.0  # … and then for their files to be written
    drain_queued_ms_max: float = 0.0  # writer process: a drain behind the items queued for the child
    drain_child_ms_max: float = 0.0  # … then until the child's reply came back
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _steps: list[StepCost] = field(default_factory=list, repr=False, compare=False)
    _device: list[tuple[float, float]] = field(default_factory=list, repr=False, compare=False)
    _held: list[float] = field(default_factory=list, repr=False, compare=False)
    _writes: list[float] = field(default_factory=list, repr=False, compare=False)
    #: a writer process's own write fields (write_s, files, write_ms_*), as its last drain reported them
    writer_fields: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def add_step(self, step: StepCost) -> None:
        """One finished step of the forward thread: adds to the totals and keeps it for percentiles."""
        with self._lock:
            self.steps += 1
            self.forward_thread_s += step.total_ms / 1000
            self.buffer_wait_s += step.wait_ms / 1000
            if len(self._steps) < MAX_STEPS:
                self._steps.append(step)

    def add_step_timing(self, timing: tuple[Any, ...] | None) -> None:
        """Add one step's event timings (start, kernels_end, copy_start, copy_end), once all have happened."""
        if timing is None:
            return
        start, kernels_end, copy_start, copy_end = timing
        device, copy = start.elapsed_time(kernels_end), copy_start.elapsed_time(copy_end)
        with self._lock:
            self.device_ms += device
            self.copy_ms += copy
            self.timed_steps += 1
            if len(self._device) < MAX_STEPS:
                self._device.append((device, copy))

    def add_write(self, seconds: float) -> None:
        """One file written in seconds."""
        with self._lock:
            self.write_s += seconds
            self.files += 1
            if len(self._writes) < MAX_STEPS:
                self._writes.append(1000 * seconds)

    def add_drain(self, steps_ms: float, files_ms: float) -> None:
        """One waiting drain: ms until every submitted step was assembled, then until its files were in."""
        with self._lock:
            self.drain_steps_ms_max = max(self.drain_steps_ms_max, steps_ms)
            self.drain_files_ms_max = max(self.drain_files_ms_max, files_ms)

    def add_drain_route(self, queued_ms: float, child_ms: float) -> None:
        """One waiting drain through a writer process: ms behind this side's queue, then in the child."""
        with self._lock:
            self.drain_queued_ms_max = max(self.drain_queued_ms_max, queued_ms)
            self.drain_child_ms_max = max(self.drain_child_ms_max, child_ms)

    def add_held(self, ms: float) -> None:
        """How long the writer held one step's pinned buffer (submit to release)."""
        with self._lock:
            if len(self._held) < MAX_STEPS:
                self._held.append(ms)

    def fields(self) -> dict[str, Any]:
        """The `capture_costs` milestone fields: totals, per-step means and the spread over steps."""
        with self._lock:
            steps, timed = max(self.steps, 1), max(self.timed_steps, 1)
            per_step = [s.total_ms for s in self._steps]
            known = [s for s in self._steps if s.gpu_idle is not None]
            kept = max(len(self._steps), 1)
            out: dict[str, Any] = {
                "steps": self.steps,
                "forward_thread_s": round(self.forward_thread_s, 4),
                "buffer_wait_s": round(self.buffer_wait_s, 4),
                "forward_thread_ms_per_step": round(1000 * self.forward_thread_s / steps, 3),
                "forward_thread_ms_p50": round(percentile(per_step, 0.5), 3),
                "forward_thread_ms_p90": round(percentile(per_step, 0.9), 3),
                "forward_thread_ms_max": round(max(per_step, default=0.0), 3),
                "begin_ms_per_step": round(sum(s.begin_ms for s in self._steps) / kept, 3),
                "launch_ms_per_step": round(sum(s.launch_ms for s in self._steps) / kept, 3),
                "end_ms_per_step": round(sum(s.end_ms for s in self._steps) / kept, 3),
                "buffer_wait_steps": sum(1 for s in self._steps if s.wait_ms > 0.1),
                # the GPU had finished all queued work when the capture launched: the host was behind it
                "gpu_idle_launches": sum(1 for s in known if s.gpu_idle),
                "device_ms_per_step": round(self.device_ms / timed, 3),
                "device_ms_p50": round(percentile([d for d, _ in self._device], 0.5), 3),
                "copy_ms_per_step": round(self.copy_ms / timed, 3),
                "buffer_held_ms_p50": round(percentile(self._held, 0.5), 3),
                "buffer_held_ms_max": round(max(self._held, default=0.0), 3),
                "write_s": round(self.write_s, 3),
                "files": self.files,
                "write_ms_p50": round(percentile(self._writes, 0.5), 3),
                "write_ms_max": round(max(self._writes, default=0.0), 3),
                "drain_steps_ms_max": round(self.drain_steps_ms_max, 3),
                "drain_files_ms_max": round(self.drain_files_ms_max, 3),
                "drain_queued_ms_max": round(self.drain_queued_ms_max, 3),
                "drain_child_ms_max": round(self.drain_child_ms_max, 3),
            }
            out.update(self.writer_fields)
            return out

    def trace(self) -> list[dict[str, Any]]:
        """One row per kept step (forward-thread costs, then device/copy/held ms where known), for a file."""
        with self._lock:
            t0 = self._steps[0].at if self._steps else 0.0
            rows = []
            for i, s in enumerate(self._steps):
                row: dict[str, Any] = {
                    "t_s": round(s.at - t0, 4),
                    "tokens": s.tokens,
                    "begin_ms": round(s.begin_ms, 3),
                    "launch_ms": round(s.launch_ms, 3),
                    "wait_ms": round(s.wait_ms, 3),
                    "end_ms": round(s.end_ms, 3),
                    "gpu_idle": s.gpu_idle,
                }
                if i < len(self._device):
                    row["device_ms"], row["copy_ms"] = (round(x, 3) for x in self._device[i])
                if i < len(self._held):
                    row["held_ms"] = round(self._held[i], 3)
                rows.append(row)
            return rows
