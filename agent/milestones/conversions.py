"""Pure: a rule's field conversions (``fields = { tokens = "int" }``), captured text → JSON values."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any

_NUM_RE = re.compile(r"[-+]?(?:\d[\d,_ ]*)?\.?\d+(?:[eE][-+]?\d+)?")
_UNIT_TO_GIB = {
    "": 1.0, "gib": 1.0, "g": 1.0, "gb": 1e9 / 2**30, "mib": 1 / 1024, "mb": 1e6 / 2**30,
    "kib": 1 / 2**20, "kb": 1e3 / 2**30, "tib": 1024.0, "tb": 1e12 / 2**30, "b": 1 / 2**30,
}  # fmt: skip


def _number(raw: str) -> str:
    m = _NUM_RE.search(raw)
    if not m:
        raise ValueError(f"no number in {raw!r}")
    return m.group().replace(",", "").replace("_", "").replace(" ", "")


def _to_int(raw: str) -> int:
    try:
        return int(raw)  # the common case, without the regex
    except ValueError:
        pass
    num = _number(raw)
    return int(num) if re.fullmatch(r"[-+]?\d+", num) else int(float(num))


def _to_float(raw: str) -> float:
    try:
        value = float(raw)  # the common case, without the regex
    except ValueError:
        value = float(_number(raw))
    if not math.isfinite(value):  # nan/inf would not be valid JSON
        raise ValueError(f"not a finite number: {raw!r}")
    return value


def _to_gib(raw: str) -> float:
    m = _NUM_RE.search(raw)
    if not m:
        raise ValueError(f"no number in {raw!r}")
    unit = re.match(r"\s*([A-Za-z]*)", raw[m.end() :])
    factor = _UNIT_TO_GIB.get(unit.group(1).lower() if unit else "", 1.0)
    value = float(m.group().replace(",", "").replace("_", "").replace(" ", "")) * factor
    if not math.isfinite(value):  # "1e999 GiB" would be inf, which is not JSON
        raise ValueError(f"not a finite size: {raw!r}")
    return value


def _to_list(raw: str) -> list[Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        value = ast.literal_eval(raw)  # vLLM prints Python reprs: ['a', 'b']
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"not a list: {raw[:80]!r}")
    json.dumps(value)  # only JSON-representable items (bytes, sets... raise TypeError)
    return list(value)


def _to_clock(raw: str) -> int:
    """tqdm's "[H:]MM:SS" → seconds."""
    parts = raw.strip().split(":")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a clock time: {raw[:40]!r}")
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds


CONVERTERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "clock": _to_clock,
    "int": _to_int,
    "float": _to_float,
    "gib": _to_gib,
    "percent": _to_float,
    "seconds": _to_float,
    "list": _to_list,
}


#: What a converter may raise on a value it cannot read (the value then stays a string).
CONVERT_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError)


def convert(kind: str, raw: str) -> Any:
    """Convert a captured group; on failure keep the raw string (a log line never breaks ingestion)."""
    try:
        return CONVERTERS[kind](raw)
    except CONVERT_ERRORS:
        return raw
