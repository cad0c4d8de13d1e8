"""The capture's tuning knobs, read once from the worker's environment (the job's env reaches every worker).

`EAGLEWATCH_SWITCH_INTERVAL_MS` sets the worker's GIL switch interval (Python's default 5 ms is how long
a thread that wants the GIL may wait behind one that holds it: the forward thread's time in the capture is
on the step's critical path). `EAGLEWATCH_PINNED_BUFFERS` and `EAGLEWATCH_WRITERS` size the pinned buffer
pool and the writer threads. `EAGLEWATCH_WRITEBACK_MB` bounds the capture bytes on their way to disk
(agent/extract/writeback.py; 0 leaves it to the kernel). `EAGLEWATCH_RESULTS_OVERLAP=0` takes each drain's
results in between batches instead of beside the next one (agent/extract/results_lane.py; the driver reads
it). `EAGLEWATCH_COSTS_TRACE` names a file that receives one JSON row per step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from agent.extract.writeback import DEFAULT_LIMIT_MB

#: the GIL switch interval the worker runs with unless told otherwise (Python's own default is 5 ms)
DEFAULT_SWITCH_INTERVAL_MS: float | None = None
DEFAULT_PINNED_BUFFERS = 6
DEFAULT_WRITERS = 4


@dataclass(frozen=True)
class Tuning:
    """What the worker runs with; reported in capture_configured."""

    switch_interval_ms: float | None = DEFAULT_SWITCH_INTERVAL_MS
    pinned_buffers: int = DEFAULT_PINNED_BUFFERS
    writers: int = DEFAULT_WRITERS
    writeback_mb: int = DEFAULT_LIMIT_MB
    results_overlap: bool = True
    trace: str | None = None

    def fields(self) -> dict[str, object]:
        """The capture_configured fields (the trace path only when set)."""
        out = {k: v for k, v in asdict(self).items() if k != "trace"}
        return {**out, **({"trace": self.trace} if self.trace else {})}


def _number(env: Mapping[str, str], name: str, low: float, high: float) -> float | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={text!r}: expected a number from {low:g} to {high:g}")
    return value


def from_env(env: Mapping[str, str] | None = None) -> Tuning:
    """The knobs from env (default os.environ); ValueError naming the variable when one is malformed."""
    env = os.environ if env is None else env
    switch = _number(env, "EAGLEWATCH_SWITCH_INTERVAL_MS", 0.01, 100.0)
    buffers = _number(env, "EAGLEWATCH_PINNED_BUFFERS", 2, 64)
    writers = _number(env, "EAGLEWATCH_WRITERS", 1, 64)
    writeback = _number(env, "EAGLEWATCH_WRITEBACK_MB", 0, 65536)
    whole = (
        ("EAGLEWATCH_PINNED_BUFFERS", buffers),
        ("EAGLEWATCH_WRITERS", writers),
        ("EAGLEWATCH_WRITEBACK_MB", writeback),
    )
    for name, value in whole:
        if value is not None and value != int(value):
            raise ValueError(f"{name}={env[name]!r}: expected a whole number")
    overlap = env.get("EAGLEWATCH_RESULTS_OVERLAP", "").strip()
    if overlap not in ("", "0", "1"):
        raise ValueError(f"EAGLEWATCH_RESULTS_OVERLAP={overlap!r}: expected 0 or 1")
    return Tuning(
        switch_interval_ms=switch if switch is not None else DEFAULT_SWITCH_INTERVAL_MS,
        pinned_buffers=int(buffers) if buffers is not None else DEFAULT_PINNED_BUFFERS,
        writers=int(writers) if writers is not None else DEFAULT_WRITERS,
        writeback_mb=int(writeback) if writeback is not None else DEFAULT_LIMIT_MB,
        results_overlap=overlap != "0",
        trace=env.get("EAGLEWATCH_COSTS_TRACE") or None,
    )
