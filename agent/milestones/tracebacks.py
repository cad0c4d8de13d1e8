"""Pure: one process's Python traceback followed line by line, up to its exception line.

Every line of the same process (same prefix; other processes' lines interleave freely) belongs to it;
chained exceptions continue it.  The engine classifies the exception lines with its ``error`` rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.milestones.logline import process_tag

TRACEBACK_START = "Traceback (most recent call last)"
MAX_TRACEBACK_LINES = 1000

_FRAME_RE = re.compile(r'\s*File "(?P<file>[^"]*)", line (?P<lineno>\d+)(?:, in (?P<func>.+))?')
_EXC_RE = re.compile(r"(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")

#: what a line did to a traceback: part of it; part of it and the last one it may hold; not part of it
#: (the traceback ended before this line, which is classified on its own)
Step = Literal["taken", "full", "ended"]


@dataclass
class Trace:
    """An open traceback of process ``proc`` (its first line ``line``); JSON-able for engine snapshots."""

    line: int
    rank: int | None
    proc: str
    last_line: int
    frames: list[str] = field(default_factory=list)
    excs: list[list[str]] = field(default_factory=list)  # [type, message, full line text]
    n_lines: int = 1
    state: str = "body"  # body | after_exc | chain
    #: the Traceback line's indentation: rich's log handler indents a whole traceback under its record
    indent: int = 0


def opened(message: str, line: int, rank: int | None, proc: str) -> Trace | None:
    """The traceback a line's message starts, or None when it starts none."""
    stripped = message.lstrip()
    if not stripped.startswith(TRACEBACK_START):
        return None
    return Trace(line=line, rank=rank, proc=proc, last_line=line, indent=len(message) - len(stripped))


def take(tr: Trace, message: str, text: str, line: int) -> Step:
    """Feed one line of the traceback's process (``message``: the line after its prefix and header)."""
    msg = message
    if tr.indent and msg[: tr.indent].isspace():
        msg = msg[tr.indent :]
    stripped = msg.strip()
    if tr.state == "after_exc":
        if not stripped:
            return "taken"
        if stripped.startswith(_CHAIN):
            tr.state = "chain"
            return "taken"
        return "ended"
    tr.last_line = line
    tr.n_lines += 1
    if stripped.startswith(TRACEBACK_START):
        tr.state = "body"
    elif not stripped or msg[:1] in (" ", "\t"):
        f = _FRAME_RE.match(msg)
        if f:
            where = f"{f.group('file').rsplit('/', 1)[-1]}:{f.group('lineno')}"
            tr.frames.append(f"{where} in {f.group('func')}" if f.group("func") else where)
    elif tr.state == "chain":
        return "taken"
    else:
        em = _EXC_RE.match(stripped)
        exc_type, exc_msg = (em.group("type"), em.group("msg") or "") if em else (stripped, "")
        tr.excs.append([exc_type, exc_msg[:2000], text])
        tr.state = "after_exc"
    return "full" if tr.n_lines >= MAX_TRACEBACK_LINES else "taken"


def summary(tr: Trace) -> tuple[dict[str, Any], str]:
    """The closed traceback's own ``error`` fields (last five frames, chain, lines) and its text: the last
    exception line, tagged with its process when the line itself does not say it."""
    fields = {"frames": tr.frames[-5:], "chain": [e[0] for e in tr.excs], "lines": tr.n_lines}
    text = tr.excs[-1][2] if tr.excs else "Traceback (most recent call last):"
    tag = process_tag(tr.proc + " ")  # kept when no exception line ended it
    if tag is not None and process_tag(text) is None:
        text = f"[{tag}] {text}"
    return fields, text
