"""Adversarial inputs (fixed seeds, bounded): markers, conversions, protocol lines that must never raise."""

from __future__ import annotations

import contextlib
import json
import random
import re
import time

import pytest

from agent.milestones.engine import MilestoneEngine, load_rules
from agent.milestones.regex_safety import check_user_regex
from agent.milestones.rulefile import RuleError, convert
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


_ATOMS = ["a", r"\w", r"\d", ".", "[ab]", "(?:a|ab)", "(?:x|y)"]
_QUANTS = ["+", "*", "{2,}", "{1,9}"]


def test_random_nested_quantifiers_are_refused_in_user_rules() -> None:
    rng = random.Random(99)
    for _ in range(300):
        inner = rng.choice(_ATOMS) + rng.choice(_QUANTS)
        for _ in range(rng.randint(0, 2)):  # wrap in more groups, quantified or not
            inner = f"(?:{inner}{rng.choice(['', 'b', '|c'])}){rng.choice(['', '?'])}"
        pattern = f"{rng.choice(['', '^', 'x'])}({inner}){rng.choice(_QUANTS)}{rng.choice(['', '$', 'z'])}"
        problem = check_user_regex(pattern)
        assert problem is not None, pattern
        with pytest.raises(RuleError, match=re.escape("spec.rules: rule[0] 'r': field 'regex'")):
            load_rules(extra=[{"name": "r", "kind": "progress", "regex": pattern}])


@pytest.mark.parametrize(
    "pattern",
    [r"(?:GPU|CPU) KV cache size: (?P<t>[\d,]+)", r"(?P<x>\d+(?:\.\d+)?) s", r"step (\d+)/(\d+)", r"(a|b)+"],
)
def test_ordinary_user_regexes_are_accepted(pattern: str) -> None:
    assert check_user_regex(pattern) is None


def test_user_rules_search_a_bounded_prefix_quickly() -> None:
    rules = load_rules(extra=[{"name": "poly", "kind": "progress", "words": "go", "regex": r".*x.*y"}])
    engine = MilestoneEngine(rules)
    start = time.monotonic()
    for n in range(1, 4):
        engine.feed("go " + "x" * 100_000, n)
    assert time.monotonic() - start < 10  # unbounded, one such line alone takes hours


@pytest.mark.parametrize("pattern", [r"\d+\d+x", r".*.*=", r"(\w+)(\d*)!", r"a*(?:a+b)", r"[^x]+\s+y"])
def test_adjacent_overlapping_quantifiers_are_refused(pattern: str) -> None:
    assert "in a row" in (check_user_regex(pattern) or ""), pattern
