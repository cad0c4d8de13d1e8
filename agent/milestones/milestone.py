"""Pure: the Milestone record the rule engine releases (the ``milestones --json`` shape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Milestone:
    """One milestone: stable kind, 1-based line number, TP rank (null when deduped or unknown).

    Not frozen: one is made for every milestone line, and a frozen dataclass's ``__init__`` costs three
    times as much; nothing changes a milestone's attributes once it is made (``dataclasses.replace``
    makes a new one)."""

    kind: str
    line: int
    rank: int | None
    fields: dict[str, Any]
    text: str

    def to_dict(self) -> dict[str, Any]:
        """The ``eaglewatch-agent milestones --json`` shape."""
        return {
            "kind": self.kind,
            "line": self.line,
            "rank": self.rank,
            "fields": self.fields,
            "text": self.text,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Milestone:
        """Inverse of to_dict."""
        return cls(d["kind"], d["line"], d["rank"], dict(d["fields"]), d["text"])
