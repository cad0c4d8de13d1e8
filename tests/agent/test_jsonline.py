"""Journal lines (agent/runs/journal.py): the template path writes the bytes of the plain JSON encoder."""

from __future__ import annotations

import enum
import json
import math
from typing import Any

from agent.runs.journal import encode_lines

TS = 1764553921.123


class Level(enum.IntEnum):
    HIGH = 3


def _plain(event: dict[str, Any]) -> bytes:
    """One line as the plain JSON encoder writes it, NaN/Infinity as null."""

    def finite(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    try:
        text = json.dumps(event, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(finite(event), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8") + b"\n"


def _milestone(i: int, **over: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "milestone",
        "kind": "throughput" if i % 2 else "progress",
        "line": 10 * i,
        "rank": None if i % 3 else i % 8,
        "fields": {"rule": "throughput", "tokens_per_s": 1000.0 + i / 7, "running": i, "ok": bool(i % 2)},
        "text": f"(APIServer pid=1000) INFO line {i}: Avg prompt throughput: {i / 3:.1f} tokens/s",
    }
    ev.update(over)
    return ev


def _events() -> list[dict[str, Any]]:
    """Milestones and other events with the values JSON is particular about."""
    odd = [
        _milestone(1, text='é ✓ 😀 \u2028 \x00 \x1f tab\t "quoted" back\\slash'),
        _milestone(2, fields={"tiny": 1e-7, "huge": 1e22, "sum": 0.1 + 0.2, "neg0": -0.0, "big": 2**70}),
        _milestone(3, fields={"nested": {"list": [1, 2.5, None, {"deep": ["x", True]}], "t": (1, 2)}}),
        _milestone(4, fields={"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 1.5}),
        _milestone(5, fields={"level": Level.HIGH, 7: "int key", None: "none key"}),
        _milestone(6, rank=Level.HIGH),
        _milestone(7, fields=[1, 2]),
        {"kind": "progress", "type": "milestone", "line": 1, "rank": None, "fields": {}, "text": ""},
        {"type": "state", "state": "completed", "reason": "exit 0", "exit": {"code": 0, "signal": None}},
        {"type": "check", "file": "f é.safetensors", "ok": False, "problems": [{"nan": math.nan}]},
    ]
    return [_milestone(i) for i in range(8, 60)] + odd + [_milestone(i) for i in range(60, 80)]


def test_encode_lines_writes_the_plain_json_bytes() -> None:
    full = [{"seq": i + 1, "ts": TS, **ev} for i, ev in enumerate(_events())]
    full.append({"seq": 999, "ts": -0.0, **_milestone(1)})
    full.append({"seq": 1000, "ts": math.nan, **_milestone(2)})
    assert encode_lines(full) == b"".join(map(_plain, full))
