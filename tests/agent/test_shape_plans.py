"""Plans per line shape (agent/milestones/plans.py): a known shape's rule and spans give exactly what the
full path gives — for lines that differ only in digits (digit-uniform rules at remembered spans, rules that
name digits verified on each line), for lines that differ in anything else (another shape), for markers,
``once`` rules and rank groups — and the pieces they rest on (digit_uniform, line_layout, texts_at)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from agent.logs.splitter import BlockLines, LineSplitter, clean_block
from agent.milestones import logline
from agent.milestones.engine import Milestone, MilestoneEngine, load_rules
from agent.milestones.logline import line_layout, parse_line
from agent.milestones.plans import digit_uniform, fields_builder
from agent.milestones.rulefile import RuleSet, convert
from tests.helpers.vllm_log import FAILURES, make_log, steady_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _texts(data: bytes) -> list[str]:
    sp = LineSplitter()
    return [ln.text for ln in sp.feed(data) + sp.flush()]


def _reference(rules: RuleSet, texts: list[str], world: int | None = None) -> list[dict[str, object]]:
    """``feed`` line by line: no prefilter, no plans."""
    eng = MilestoneEngine(rules, world)
    out = [m for i, t in enumerate(texts) for m in eng.feed(t, i + 1)]
    return [m.to_dict() for m in out + eng.flush()]


def _planned(
    rules: RuleSet, texts: list[str], world: int | None = None, batch: int = 50
) -> list[dict[str, object]]:
    """``feed_block`` over raw blocks of ``batch`` lines (the watcher's path, plans on)."""
    eng = MilestoneEngine(rules, world)
    out: list[Milestone] = []
    for at in range(0, len(texts), batch):
        data = "".join(t + "\n" for t in texts[at : at + batch]).encode()
        block = clean_block(data, 0, 1 << 20)
        assert block is not None
        out += eng.feed_block(block, at + 1)
    return [m.to_dict() for m in out + eng.flush()]


def _scramble_digits(text: str, rnd: random.Random) -> str:
    """``text`` with each ASCII digit replaced at random: a line of the same shape."""
    return re.sub(r"[0-9]", lambda _m: rnd.choice("0123456789"), text)


@pytest.mark.parametrize(
    ("pattern", "uniform"),
    [
        (r"Loading weights took (?P<s>[\d.]+) seconds", True),
        (r"[0-9]+ of [!-~]+", True),  # ranges that hold every digit or none
        (r"x{3,5} [a-z]\w+\b\s\S", True),
        (r"(?P<a>x)?(?(a)y|z)", True),
        (r"(?i)error", True),
        (r"(?=.*?Running: (?P<r>\d+))", True),
        (r"status 1\d\d", False),  # a digit literal
        (r"[1-9]", False),  # part of the digits
        (r"[/-5]", False),
        (r"[^0]", False),
        (r"\x31", False),
        (r"(\d)\1", False),  # a back-reference compares digits
        (r"(?<=7)x", False),
    ],
)
def test_digit_uniform(pattern: str, uniform: bool) -> None:
    assert digit_uniform(re.compile(pattern)) is uniform


def test_the_layout_patterns_are_digit_uniform() -> None:
    """What makes one layout hold for every line of a shape."""
    patterns = (logline._PREFIX_RE, logline._HEADER_RE, logline._TP_RE, logline._TAG_RE)
    assert all(digit_uniform(p) for p in patterns)


def test_line_layout_cuts_lines_as_parse_line_does() -> None:
    texts = [t for p in sorted(FIXTURES.glob("*.log")) for t in _texts(p.read_bytes())]
    texts += [
        *_texts(make_log(tp=4, fmt="old")),
        "[server] (Worker_TP3 pid=7) INFO 02-21 22:48:03 [x.py:1] hi",
        "[client] plain",
        "(VllmWorker rank=5 pid=9) WARNING 02-21 22:48:03.123 x.py:1] old header",
        "(RayWorkerWrapper-12 pid=7, ip=10.0.0.2) ERROR 02-21 22:48:03 [x.py:1] boom",
        "",
    ]
    for text in texts:
        want, lay = parse_line(text), line_layout(text)
        assert (
            lay.proc(text),
            None if lay.rank is None else int(text[slice(*lay.rank)]),
            lay.level,
            text[lay.message :],
        ) == (
            want.proc,
            want.rank,
            want.level,
            want.message,
        ), text


def test_fields_builder_converts_as_convert_does() -> None:
    rule = load_rules(extra=[{
        "name": "nums", "kind": "progress", "words": "nums",
        "regex": r"nums (?P<i>\S+) (?P<f>\S+) (?P<p>\S+) (?P<g>\S+) (?P<s>\S+)(?: (?P<absent>x))?",
        "fields": {"i": "int", "f": "float", "p": "percent", "g": "gib"},
        "set": {"unit": "GiB"},
    }]).rules[-1]  # fmt: skip
    build = fields_builder(rule)
    for line in [
        "nums 12 1.5 50.0 2 s",
        "nums 1,024 1e999 nan 512MiB s",
        "nums x y z w s",
        "nums -0 +1 0 0 s",
    ]:
        m = rule.regex.search(line)
        assert m is not None
        want = (
            {"rule": "nums"}
            | {
                k: v if k == "s" else convert(rule.fields[k], v)
                for k, v in m.groupdict().items()
                if v is not None
            }
            | {"unit": "GiB"}
        )
        assert build(m.string, m.regs) == want, line


DIGIT_RULES: list[dict[str, Any]] = [
    # a rule that names digits, before a uniform one for the same lines
    {"name": "http_ok", "kind": "progress", "words": "status", "regex": r"status 2\d\d (?P<what>\w+)"},
    {"name": "http_any", "kind": "warning", "words": "status",
     "regex": r"status (?P<code>\d+) (?P<what>\w+)"},
    # a uniform rule first, then one that names digits
    {"name": "step", "kind": "progress", "words": "step", "regex": r"step (?P<n>\d+) of (?P<of>\d+) done",
     "fields": {"n": "int", "of": "int"}},
    {"name": "step_ten", "kind": "progress", "words": "step", "regex": r"step 10 of"},
    {"name": "wave", "kind": "progress", "words": "wave", "regex": r"wave (?P<w>\d+)", "once": True},
]  # fmt: skip


def test_a_rule_that_names_digits_is_verified_on_each_line() -> None:
    """Lines of one shape where the first line's rule does not match a later one, or an earlier rule that
    names digits matches a later one: each line gets what the full path gives it."""
    rules = load_rules(extra=DIGIT_RULES)
    cases = [
        (["status 200 ok", "status 500 ok", "status 201 ok", "status 404 ok"], ["http_ok", "http_any"] * 2),
        (["status 500 ok", "status 200 ok", "status 201 ok", "status 404 ok"],
         ["http_any", "http_ok", "http_ok", "http_any"]),
        (["step 10 of 20", "step 12 of 20", "step 11 of 20 done", "step 10 of 99 done"],
         ["step_ten", None, "step", "step"]),
        (["wave 1", "wave 2", "wave 3"], ["wave", None, None]),
    ]  # fmt: skip
    for texts, names in cases:
        want = _reference(rules, texts)
        got = {m["line"]: m["fields"]["rule"] for m in want}  # type: ignore[index]
        assert [got.get(i + 1) for i in range(len(texts))] == names, texts
        for batch in (1, 3, 50):
            assert _planned(rules, texts, batch=batch) == want


def test_a_line_differing_in_more_than_digits_gets_no_remembered_rule() -> None:
    """Another shape: the shape folds digits only, so ``...throughput: 1.0 tokens/s`` and the same line with
    one letter changed are two shapes, and the changed one matches nothing."""
    rules = load_rules(backend="worker-extension")
    good = (
        "(APIServer pid=1000) INFO 02-21 22:48:12 [loggers.py:220] Engine 000: Avg prompt throughput: 1.0 "
        "tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 8 reqs, Waiting: 0 reqs"
    )
    bad = good.replace("tokens/s,", "tokens/x,", 1)
    marker = 'EAGLEWATCH {"kind": "progress", "samples_done": 10}'
    texts = [good, bad, good.replace("1.0", "7.5"), bad, marker, marker.replace("progress", "progres")]
    want = _reference(rules, texts)
    assert [m["line"] for m in want] == [1, 3, 5, 6]
    assert want[3]["fields"]["rule"] == "bad_marker"  # type: ignore[index]
    assert _planned(rules, texts) == want


@pytest.mark.parametrize("seed", range(3))
def test_digit_scrambled_logs_give_what_the_full_path_gives(seed: int) -> None:
    """Every line of real and synthetic logs with its digits replaced at random (same shapes, other values:
    ranks, pids, leading zeros in markers, numbers too large, times) — planned path == line by line."""
    rnd = random.Random(seed)
    texts = [t for p in sorted(FIXTURES.glob("*.log")) for t in _texts(p.read_bytes())]
    texts += [t for f in FAILURES[:4] for t in _texts(make_log(tp=4, failure=f))]
    texts += [
        *steady_lines(600, tp=4),
        'EAGLEWATCH {"kind": "progress", "samples_done": 10, "rate": 1.5, "x": -20, "e": 1e5, "s": "ab12"}',
        'EAGLEWATCH {"kind": "progress", "samples_done": 1' + "0" * 5000 + "}",
    ]
    scrambled = [_scramble_digits(t, rnd) for t in texts for _ in range(2)]
    rules = load_rules(extra=DIGIT_RULES)
    for world in (None, 4):
        want = _reference(rules, scrambled, world)
        assert len(want) > 50
        assert _planned(rules, scrambled, world, batch=rnd.choice([7, 200, 5000])) == want


def test_an_optional_json_group_of_a_marker_rule_is_a_line_error_on_both_paths() -> None:
    rules = load_rules(extra=[{
        "name": "mine", "kind": "progress", "words": "MINE", "marker": True,
        "regex": r"MINE(?: (?P<json>\{.*))?",
    }])  # fmt: skip
    texts = ['MINE {"kind": "progress", "n": 1}', "MINE", 'MINE {"kind": "progress", "n": 2}', "MINE"]
    want = _reference(rules, texts)
    assert [m["fields"].get("rule") for m in want] == [None, "line_error", None, "line_error"]  # type: ignore[attr-defined]
    assert _planned(rules, texts, batch=2) == want


def test_block_texts_at_any_ascending_lines() -> None:
    rnd = random.Random(5)
    lines = [f"line {i} " + "x" * rnd.randint(0, 40) for i in range(300)]
    block = clean_block("".join(t + "\n" for t in lines).encode(), 0, 1 << 20)
    assert block is not None
    for _ in range(20):
        idx = sorted(rnd.sample(range(300), rnd.randint(0, 300)))
        assert BlockLines(block).texts_at(idx) == [lines[i] for i in idx]


def test_steady_lines_run_on_remembered_spans() -> None:
    """The plans are used: the steady log's throughput and marker shapes hold spans (no regex per line),
    a rule that names digits is verified, and a shape whose earlier candidate names digits has no plan."""
    eng = MilestoneEngine(load_rules(extra=DIGIT_RULES))
    texts = [*steady_lines(400, tp=4), "status 200 ok", "status 500 ok", "step 10 of 20", "step 11 of 20"]
    block = clean_block("".join(t + "\n" for t in texts).encode(), 0, 1 << 20)
    assert block is not None
    eng.feed_block(block, 1)
    by_rule = {
        (p.rule.name if p and p.rule else None, p is not None and p.regs is not None)
        for p in eng._plans.plans.values()
    }
    assert {("throughput", True), ("eaglewatch_marker", True), ("step_ten", False)} <= by_rule
    assert ("http_ok", False) in by_rule


def test_plans_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines of free text never repeat their shape: the plans are forgotten past MAX_PLANS, and the lines
    after that still get what the full path gives."""
    monkeypatch.setattr("agent.milestones.plans.MAX_PLANS", 5)
    rules = load_rules(extra=DIGIT_RULES)
    texts = [f"step {i} of 9 done {'x' * (i % 13)}" for i in range(60)] + ["status 200 ok", "wave 3"]
    eng = MilestoneEngine(rules)
    block = clean_block("".join(t + "\n" for t in texts).encode(), 0, 1 << 20)
    assert block is not None
    got = [m.to_dict() for m in eng.feed_block(block, 1) + eng.flush()]
    assert len(eng._plans.plans) <= 5
    assert got == _reference(rules, texts)


@pytest.mark.parametrize("memo_max", [1, 3, 1 << 16])
def test_a_shape_answered_line_by_line_gets_no_plan(monkeypatch: pytest.MonkeyPatch, memo_max: int) -> None:
    """``200% Completed`` and ``100% Completed`` share a shape that a literal with a digit decides line by
    line: neither line's candidates may be remembered for the shape, even when the prefilter's memo was
    just forgotten."""
    monkeypatch.setattr("agent.milestones.logline.MEMO_MAX", memo_max)
    # a rule both lines are candidates for and neither matches: a plan learnt from 200%'s candidates alone
    # would say "no rule matches this shape"
    rules = load_rules(extra=[{"name": "never", "kind": "progress", "words": "checkpoint", "regex": "never"}])
    done = "Loading safetensors checkpoint shards: 100% Completed | 4/4 [00:04<00:00, 1.02it/s]"
    half = "Loading safetensors checkpoint shards: 200% Completed | 8/4 [00:02<00:02, 1.02it/s]"  # same shape
    filler = [f"INFO 02-21 22:48:0{i} [x.py:1] weights {'y' * i}" for i in range(6)]
    for texts in ([half, *filler, done, half, done], [done, half, *filler, done]):
        want = _reference(rules, texts)
        assert any(m["fields"]["rule"] == "weight_shards_done" for m in want)  # type: ignore[index]
        for batch in (1, 2, 50):
            assert _planned(rules, texts, batch=batch) == want
