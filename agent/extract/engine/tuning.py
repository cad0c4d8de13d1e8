"""The capture's tuning, read once from the worker's environment (the job's env reaches every worker).

Buffers, writers, the write-back bound and the costs trace are settings of agent/settings.py; `Tuning` is
what one worker runs with, reported in the capture_configured milestone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from agent import settings


@dataclass(frozen=True)
class Tuning:
    """What the worker runs with; reported in capture_configured."""

    pinned_buffers: int
    writers: int
    writeback_mb: int
    trace: str | None

    def fields(self) -> dict[str, object]:
        """The capture_configured fields (the trace path only when set)."""
        out = {k: v for k, v in asdict(self).items() if k != "trace"}
        return {**out, **({"trace": self.trace} if self.trace else {})}


def from_env(env: Mapping[str, str] | None = None) -> Tuning:
    """The tuning in env (default os.environ); SettingError naming the variable when one is malformed."""
    return Tuning(
        pinned_buffers=settings.PINNED_BUFFERS.get(env),
        writers=settings.WRITERS.get(env),
        writeback_mb=settings.WRITEBACK_MB.get(env),
        trace=settings.COSTS_TRACE.get(env),
    )
