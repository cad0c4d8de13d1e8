"""The run page's milestone list as a person reads it: engine configuration in one row, passes counted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from web.capture_card import MilestoneLike

#: Milestones folded into one row each: vLLM states its configuration over many lines, and a long run
#: checks thousands of good files.
FOLDED = frozenset({"engine_config", "shape_check_passed"})
#: What vLLM says when it shuts its engine down, even after a run that went well.
SHUTDOWN_KINDS = frozenset({"error", "warning"})


@dataclass
class Row:
    """One row: a stored milestone, or the first of those folded into it (``group``, oldest first)."""

    first: Any
    group: list[Any] = field(default_factory=list)
    normal: bool = False  # an error or warning that is part of a normal shutdown

    @property
    def summary(self) -> str:
        """What a folded row says before it is opened."""
        if self.first.kind == "shape_check_passed":
            files = {m.fields.get("file") for m in self.group}
            return f"{len(files)} {'file' if len(files) == 1 else 'files'} passed"
        version = next(
            (v for m in self.group if (v := m.fields.get("vllm") or m.fields.get("version"))), None
        )
        parts = [f"vLLM {version}" if version else None, f"{len(self.group)} lines"]
        return " · ".join(p for p in parts if p)


def timeline_rows(milestones: Iterable[MilestoneLike], state: str) -> list[Row]:
    """The rows in time order; a folded kind sits where it first appeared. In a completed run, errors and
    warnings after the `completed` milestone are vLLM shutting its engine down ("engine core died
    unexpectedly"): marked normal."""
    rows: list[Row] = []
    folded: dict[str, Row] = {}
    done = False
    for m in milestones:
        if m.kind in FOLDED:
            row = folded.get(m.kind)
            if row is None:
                row = folded[m.kind] = Row(m)
                rows.append(row)
            row.group.append(m)
            continue
        rows.append(Row(m, normal=m.kind == "normal_shutdown" or (done and m.kind in SHUTDOWN_KINDS)))
        done = done or (m.kind == "completed" and state == "completed")
    return rows


def passed_files(milestones: Iterable[MilestoneLike]) -> int:
    """How many files passed their checks."""
    return len({m.fields.get("file") for m in milestones if m.kind == "shape_check_passed"})
