"""Where the capture's time goes, per run: the forward thread's own time, device time, copies and writes.

Rank 0's worker keeps one `CaptureCosts`; the forward thread adds its time per step and any wait for a
free pinned buffer (the writer falling behind), the thread that waits for each step's copy reads that
step's CUDA event timings, the writer threads add their file writes. `fields()` is what the `completed`
milestone carries as `capture_costs`, so a user can tell a slow disk from a slow device step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Add to the named totals."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def add_step_timing(self, timing: tuple[Any, ...] | None) -> None:
        """Add one step's event timings (start, kernels_end, copy_start, copy_end), once all have happened."""
        if timing is None:
            return
        start, kernels_end, copy_start, copy_end = timing
        self.add(
            device_ms=start.elapsed_time(kernels_end),
            copy_ms=copy_start.elapsed_time(copy_end),
            timed_steps=1,
        )

    def fields(self) -> dict[str, Any]:
        """The `capture_costs` milestone fields: totals and per-step means."""
        with self._lock:
            steps, timed = max(self.steps, 1), max(self.timed_steps, 1)
            return {
                "steps": self.steps,
                "forward_thread_s": round(self.forward_thread_s, 4),
                "buffer_wait_s": round(self.buffer_wait_s, 4),
                "forward_thread_ms_per_step": round(1000 * self.forward_thread_s / steps, 3),
                "device_ms_per_step": round(self.device_ms / timed, 3),
                "copy_ms_per_step": round(self.copy_ms / timed, 3),
                "write_s": round(self.write_s, 3),
                "files": self.files,
            }
