"""Pure: rank groups — the milestone every TP rank prints once, reported once.

A ``per_rank`` rule's milestone opens a group keyed by the rule name; the same rule matching in another
process (rank) joins it.  It closes into one milestone (``rank`` null, ``fields.ranks``, ``fields.processes``,
the first line's other fields) when a process prints it again, when it holds ``world_size`` processes, when
``window`` lines have passed, or on flush.  Tracebacks of ranked processes are grouped the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.milestones.milestone import Milestone

_UNNAMED = "\0unnamed:"  # stands for a line without a process prefix (no real prefix holds a NUL)


@dataclass
class Group:
    """One open group: its first milestone, the processes and the ranks seen so far."""

    key: str
    first: Milestone
    procs: list[str]
    ranks: list[int]


class RankGroups:
    """The open groups by key; each method returns the milestones of the groups it closed, in order."""

    def __init__(self) -> None:
        self.open: dict[str, Group] = {}

    def join(
        self, key: str, ms: Milestone, proc: str, rank: int | None, world_size: int | None
    ) -> list[Milestone]:
        """Add ``ms`` (of process ``proc``) to group ``key``, opening it first or again."""
        out = []
        group = self.open.get(key)
        if group is not None and proc and proc in group.procs:  # no prefix names no process: never "again"
            out.append(self.close(key, world_size))
            group = None
        if group is None:
            group = self.open[key] = Group(key, ms, [], [])
        group.procs.append(proc or f"{_UNNAMED}{len(group.procs)}")
        if rank is not None and rank not in group.ranks:
            group.ranks.append(rank)
        if world_size is not None and len(group.procs) >= world_size:
            out.append(self.close(key, world_size))
        return out

    def close(self, key: str, world_size: int | None) -> Milestone:
        """Close group ``key``: its one milestone."""
        g = self.open.pop(key)
        fields = dict(g.first.fields)
        fields["ranks"] = sorted(g.ranks)
        fields["processes"] = len(g.procs)
        unnamed = sum(p.startswith(_UNNAMED) for p in g.procs)
        if unnamed and not g.ranks and world_size is not None and len(g.procs) == world_size:
            # vLLM 0.26's GPU workers log their first lines (the injection) before any prefix exists: one
            # unprefixed line per rank of the world means every rank printed it
            fields["ranks"] = list(range(world_size))
            fields["ranks_inferred"] = True
        return Milestone(g.first.kind, g.first.line, None, fields, g.first.text)

    def expire(self, line: int, window: int, world_size: int | None) -> list[Milestone]:
        """Close the groups whose first line lies more than ``window`` lines before ``line``."""
        old = [k for k, g in self.open.items() if line - g.first.line > window]
        return [self.close(k, world_size) for k in old]

    def close_all(self, world_size: int | None) -> list[Milestone]:
        """Close every group."""
        return [self.close(k, world_size) for k in list(self.open)]

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-serialisable open groups."""
        return [
            {"key": g.key, "first": g.first.to_dict(), "procs": g.procs, "ranks": g.ranks}
            for g in self.open.values()
        ]

    def restore(self, snap: Any) -> None:
        """Reopen the groups of ``snapshot()``'s output; malformed ones (another version's) are skipped."""
        for g in snap if isinstance(snap, list) else []:
            try:
                self.open[g["key"]] = Group(g["key"], Milestone.from_dict(g["first"]), g["procs"], g["ranks"])
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
