"""Adversarial inputs (fixed seeds, bounded): markers, conversions, protocol lines that must never raise."""

from __future__ import annotations

import contextlib
import json
import random

import pytest

from agent.milestones.engine import MilestoneEngine, load_rules
from agent.milestones.rulefile import convert
from agent.protocol import ProtocolError, decode_message, decode_request

RULES = load_rules()
_PIECES = [
    "[",
    "]",
    "{",
    "}",
    '"',
    "\\",
    ",",
    ":",
    "NaN",
    "-Infinity",
    "Infinity",
    "1e999",
    "9" * 50,
    " ",
    "a",
]


def _strict(line: str) -> None:
    json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line[:80]!r}"))


def test_random_markers_never_raise_and_stay_strict_json() -> None:
    rng = random.Random(1701)
    engine = MilestoneEngine(RULES)
    out = []
    for n in range(1, 401):
        body = "".join(
            rng.choice(_PIECES) * rng.choice([1, 1, 2, 40, 3000]) for _ in range(rng.randint(1, 12))
        )
        out += engine.feed('EAGLEWATCH {"kind": "progress", "v": ' + body, n)
    out += engine.flush()
    assert len(out) == 400  # one milestone (or bad_marker warning) per marker line
    for m in out:
        _strict(json.dumps(m.to_dict()))


@pytest.mark.parametrize("depth", [31, 32, 33, 999, 5000, 200_000])
def test_marker_depth_boundary(depth: int) -> None:
    line = 'EAGLEWATCH {"kind": "progress", "v": ' + "[" * depth + "]" * depth + "}"
    (m,) = MilestoneEngine(RULES).feed(line, 1)
    if depth + 1 <= 32:  # the object itself is one level
        assert m.kind == "progress"
    else:
        assert m.fields["rule"] == "bad_marker"


@pytest.mark.parametrize("kind", ["int", "float", "gib", "percent", "seconds", "list"])
def test_conversions_of_hostile_text_never_raise_or_give_non_finite(kind: str) -> None:
    rng = random.Random(42)
    for _ in range(200):
        raw = "".join(rng.choice([*_PIECES, "e", ".", "GiB", "-"]) for _ in range(rng.randint(1, 8)))
        _strict(json.dumps(convert(kind, raw)))


def test_random_protocol_lines_are_refused_with_a_protocol_error() -> None:
    rng = random.Random(7)
    for _ in range(300):
        body = "".join(
            rng.choice(_PIECES) * rng.choice([1, 5, 5000, 100_000]) for _ in range(rng.randint(1, 6))
        )
        for line in (body, '{"id": ' + body + ', "op": "version"}'):
            with contextlib.suppress(ProtocolError):
                decode_request(line)
            with contextlib.suppress(ProtocolError):
                decode_message(line)
