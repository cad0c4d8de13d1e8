"""Journal lines: each event as strict JSON on one line."""

from __future__ import annotations

import json
import math
from typing import Any


def _finite(value: Any) -> Any:
    """``value`` with every NaN/Infinity float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# One encoder for every line: json.dumps with options builds a new encoder per call.
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def dump_line(event: dict[str, Any]) -> str:
    """One journal line: strict JSON, since followers (the controller, SSE) must be able to read it."""
    try:
        return _encode(event)
    except ValueError:  # a NaN/Infinity from some check or rule: null is the JSON for "no number"
        return _encode(_finite(event))


# A milestone event as the watcher writes it: its fixed keys go from a template, its fields dict and text
# through the same C encoder _encode uses (no circular check: a cycle ends in RecursionError either way).
_MILESTONE_KEYS = ("seq", "ts", "type", "kind", "line", "rank", "fields", "text")
_MILESTONE_LINE = '{"seq":%d,"ts":%s,"type":%s,"kind":%s,"line":%d,"rank":%s,"fields":%s,"text":%s}\n'
_value = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, json.JSONEncoder().default, json.encoder.encode_basestring, None, ":", ",", False, False, False
)
_string = json.encoder.encode_basestring


def _milestone_line(ev: dict[str, Any], strings: dict[str, str], stamps: dict[int, str]) -> str | None:
    """``ev``'s line as ``dump_line`` writes it, or None where only ``dump_line`` knows (another shape, a
    NaN, a subclass of int or str)."""
    if tuple(ev) != _MILESTONE_KEYS:
        return None
    seq, ts, kind, line, rank, text = ev["seq"], ev["ts"], ev["kind"], ev["line"], ev["rank"], ev["text"]
    typ = ev["type"]
    if not (
        type(seq) is int and type(ts) is float and type(line) is int and type(typ) is str
        and type(kind) is str and type(text) is str and (rank is None or type(rank) is int)
        and math.isfinite(ts)
    ):  # fmt: skip
        return None
    try:
        fields = "".join(_value(ev["fields"], 0))
    except ValueError:  # a NaN or Infinity: dump_line writes it as null
        return None
    # A batch's events share one ts object (alive all the call: its id names it; equality would take
    # -0.0 for 0.0).
    rep_ts = stamps.get(id(ts))
    if rep_ts is None:
        rep_ts = stamps[id(ts)] = repr(ts)
    return _MILESTONE_LINE % (
        seq,
        rep_ts,
        strings.get(typ) or strings.setdefault(typ, _string(typ)),
        strings.get(kind) or strings.setdefault(kind, _string(kind)),
        line,
        "null" if rank is None else rank,
        fields,
        _string(text),
    )


def encode_lines(events: list[dict[str, Any]]) -> bytes:
    """Journal lines for ``events``, each ending in a newline: ``dump_line``'s bytes, milestones (most of
    a backlog's events) built from a template."""
    strings: dict[str, str] = {}  # a batch's few types and kinds, encoded once
    stamps: dict[int, str] = {}
    out: list[str] = []
    for ev in events:
        line = _milestone_line(ev, strings, stamps)
        out.append(line if line is not None else dump_line(ev) + "\n")
    return "".join(out).encode("utf-8")
