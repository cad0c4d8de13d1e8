"""Pure: log records that are not plain vLLM text lines — JSON records, one-record exceptions, markers."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from agent.milestones.logline import ParsedLine
from agent.milestones.milestone import Milestone
from agent.milestones.rulefile import KINDS, Rule

#: Longest line taken as a JSON record; a longer one is left as text (it is then only shown, never parsed).
MAX_RECORD_CHARS = 1 << 20
#: Lines of one record's ``exc_info`` taken (the engine caps a traceback's lines too).
MAX_RECORD_LINES = 1000

_ASCTIME_RE = re.compile(r"(?:\d{4}-)?(?P<md>\d\d-\d\d)[ T](?P<hms>\d\d:\d\d:\d\d)")
_PROC_RE = re.compile(r"[A-Za-z][\w.-]*\Z")
# An exception type as Python prints it: a (dotted) name ending the way exception classes are named.
_EXC_LINE_RE = re.compile(
    r"(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault))(?::\s?(?P<msg>.*))?\Z"
)
_ERROR_LEVELS = frozenset({"ERROR", "CRITICAL"})
#: Deepest nesting of arrays/objects a marker may hold; deeper ones are bad markers (never a RecursionError).
MAX_MARKER_DEPTH = 32


def _nesting_depth(text: str, limit: int) -> int:
    """Deepest ``[``/``{`` nesting of JSON text (strings skipped); stops counting once past ``limit``."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif ch in "]}":
            depth -= 1
    return deepest


def _finite_float(raw: str) -> float | None:
    value = float(raw)
    return value if math.isfinite(value) else None  # 1e999 parses to inf, which is not JSON


# NaN, Infinity and -Infinity are accepted by Python's json but are not JSON: read them as null.
_MARKER_DECODER = json.JSONDecoder(parse_constant=lambda _name: None, parse_float=_finite_float)
#: the decoder's scanner (typeshed does not name the attribute JSONDecoder sets in __init__)
_SCAN: Callable[[str, int], tuple[Any, int]] = _MARKER_DECODER.scan_once  # type: ignore[attr-defined]


def decode_marker(raw: str) -> tuple[Any, str | None]:
    """(object, None) of a marker's JSON text, or (None, what is wrong with it)."""
    if (
        raw.count("[") + raw.count("{") > MAX_MARKER_DEPTH  # the common case, without a call
        and _nesting_depth(raw, MAX_MARKER_DEPTH) > MAX_MARKER_DEPTH
    ):
        return None, f"marker nests deeper than {MAX_MARKER_DEPTH} levels"
    try:  # JSONDecoder.raw_decode without its Python frame: one marker line in two is decoded here
        obj, _ = _SCAN(raw, 0)
    except StopIteration as err:
        return None, f"marker is not JSON: {json.JSONDecodeError('Expecting value', raw, err.value)}"[:500]
    except (ValueError, RecursionError) as exc:
        return None, f"marker is not JSON: {exc}"[:500]
    return obj, None


def marker_milestone(rule: Rule, raw: str | None, text: str, line: int, line_rank: int | None) -> Milestone:
    """The milestone a marker line (its JSON text ``raw``, matched by ``rule``) names, or a ``bad_marker``
    warning; a rank in the object wins over the line's."""
    if raw is None:  # a user's marker rule whose group "json" is optional
        raise TypeError(f"marker rule {rule.name!r}: group 'json' matched nothing")
    obj, problem = decode_marker(raw)
    if problem is None:
        if not isinstance(obj, dict):
            problem = "marker is not a JSON object"
        elif obj.get("kind", rule.kind) not in KINDS:
            problem = f"marker has unknown kind {str(obj.get('kind'))[:80]!r}"
    if problem is not None or not isinstance(obj, dict):
        fields = {"rule": "bad_marker", "severity": "warning", "problem": problem}
        return Milestone("warning", line, line_rank, fields, text)
    kind = obj.pop("kind", rule.kind)
    rank = obj.get("rank")
    return Milestone(kind, line, rank if isinstance(rank, int) else line_rank, obj, text)


def json_record_lines(text: str) -> list[str] | None:
    """The text lines of a python-json-logger record; None when ``text`` is not such a record."""
    if not text.startswith("{") or len(text) > MAX_RECORD_CHARS:
        return None
    try:
        rec = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("message"), str):
        return None
    level = rec.get("levelname")
    if not isinstance(level, str) or not level.isalpha():
        return None
    prefix = ""
    proc, pid = rec.get("processName"), rec.get("process")
    # The main process has no prefix in text logs either; a name that cannot be a prefix is left out.
    if isinstance(proc, str) and proc != "MainProcess" and _PROC_RE.match(proc) and isinstance(pid, int):
        prefix = f"({proc} pid={pid}) "
    when = _ASCTIME_RE.match(str(rec.get("asctime") or ""))
    stamp = f"{when.group('md')} {when.group('hms')}" if when else "00-00 00:00:00"
    where = rec.get("filename") or rec.get("name") or "?"
    lineno = rec.get("lineno") if isinstance(rec.get("lineno"), int) else 0
    head = f"{prefix}{level.upper()} {stamp} [{str(where).replace(' ', '_')}:{lineno}] "
    body = rec["message"].splitlines() or [""]
    exc = rec.get("exc_info")
    if isinstance(exc, str):
        body += exc.splitlines()
    return [head + part for part in body[:MAX_RECORD_LINES]]


def record_exception(parsed: ParsedLine) -> tuple[str, str] | None:
    """(type, message) of an exception logged as one ERROR record; None for any other line."""
    if parsed.level not in _ERROR_LEVELS or parsed.message[:1].isspace():
        return None
    m = _EXC_LINE_RE.match(parsed.message.rstrip())
    if m is None:
        return None
    return m.group("type"), (m.group("msg") or "")[:2000]
