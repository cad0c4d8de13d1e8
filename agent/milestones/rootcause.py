"""Pure: name the root cause of a failure on the generic wrapper errors that follow it (docs/milestones.md).

Errors less than ``GROUP_GAP`` lines apart form one failure; its root cause is the first error of the group
that is not a wrapper and is a real exception (a type and message) or of a specific class.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from agent.milestones.logline import parse_line
from agent.milestones.milestone import Milestone

#: Classes of the errors that only say "something failed before"; ``traceback`` is unclassified.
WRAPPER_CLASSES = frozenset({"engine_failed"})
GENERIC_CLASSES = frozenset({"engine_failed", "traceback"})
#: Words of a message that points elsewhere for its cause.
_POINTERS = ("see root cause above", "see stack trace for root cause", "for the root cause")
GROUP_GAP = 500
MAX_ROOT_TEXT = 500
# A log header anywhere in the line: a tqdm bar rewritten with \r often sits before the real record. vLLM's
# ("ERROR 05-01 12:00:00 [file.py:12] ") or glog's, as torch's own C++ and torchrun logs print
# ("E0501 12:00:00.123000 4242 torch/distributed/run.py:766] ").
_HEADER_ANYWHERE = re.compile(
    r"(?:(?:ERROR|CRITICAL|WARNING|INFO) \d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? \[?"
    r"|[EWIF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ )[^\s\]]+:\d+\] ?"
)


def root_text(fields: dict[str, Any], text: str) -> str:
    """``Type: message`` of an exception error, else the message part of its log line."""
    exc_type, message = fields.get("exc_type"), fields.get("message")
    if exc_type and message:
        out = f"{exc_type}: {message}"
    else:  # a rule's own line (it may name the type itself: "AttributeError: …" matched by a rule)
        heads = list(_HEADER_ANYWHERE.finditer(text))
        out = (text[heads[-1].end() :] if heads else parse_line(text).message).strip()
    return out[:MAX_ROOT_TEXT]


class RootCauses:
    """Follows released error milestones in order and annotates the wrappers of a failure."""

    def __init__(self) -> None:
        self.root: dict[str, Any] | None = None  # {"text", "class", "line"} of the group's root cause
        self.last_line: int | None = None

    def annotate(self, released: list[Milestone]) -> list[Milestone]:
        """The milestones with their wrappers annotated (others unchanged), in the same list."""
        for i, ms in enumerate(released):
            if ms.kind == "error":
                released[i] = self._error(ms)
        return released

    def _error(self, ms: Milestone) -> Milestone:
        if self.last_line is not None and abs(ms.line - self.last_line) > GROUP_GAP:
            self.root = None
        self.last_line = ms.line
        fields = ms.fields
        message = str(fields.get("message") or "").lower()
        if fields.get("class") in WRAPPER_CLASSES or any(p in message for p in _POINTERS):  # a wrapper
            if self.root is None:
                return ms
            extra = {
                "root_cause": self.root["text"],
                "root_cause_class": self.root["class"],
                "root_cause_line": self.root["line"],
            }
            return dataclasses.replace(ms, fields={**fields, **extra})
        specific = fields.get("class") not in GENERIC_CLASSES
        real = bool(fields.get("exc_type")) or specific
        if self.root is None and real and fields.get("severity", "error") != "warning":
            self.root = {"text": root_text(fields, ms.text), "class": fields.get("class"), "line": ms.line}
        return ms

    def snapshot(self) -> dict[str, Any]:
        """JSON-serialisable state for a daemon restart."""
        return {"root": self.root, "last_line": self.last_line}

    def restore(self, snap: Any) -> None:
        """Take ``snapshot()``'s output back; anything malformed leaves a fresh state."""
        if isinstance(snap, dict):
            root, last = snap.get("root"), snap.get("last_line")
            if isinstance(root, dict) and {"text", "class", "line"} <= root.keys():
                self.root = root
            self.last_line = last if isinstance(last, int) else None
