"""The rules' prefilter: ``feed_many`` (lines no rule can match skipped in bulk) gives exactly what ``feed``
line by line gives, over the real fixture logs and synthetic ones, for any batch boundaries."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import Milestone, MilestoneEngine, load_rules
from agent.milestones.logline import Gate, Prefilter
from agent.milestones.rulefile import RuleSet
from tests.helpers.vllm_log import FAILURES, make_log, steady_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXTRA_RULES = [
    {"name": "my_step", "kind": "progress", "contains": ["step "], "regex": r"step (?P<step>\d+)"},
    {"name": "my_digits", "kind": "warning", "words": ["haiku"], "regex": r"about \d+"},
]


def _texts(data: bytes) -> list[str]:
    sp = LineSplitter()
    return [ln.text for ln in sp.feed(data) + sp.flush()]


def _logs() -> list[tuple[str, list[str]]]:
    logs = [(p.name, _texts(p.read_bytes())) for p in sorted(FIXTURES.glob("*.log"))]
    logs += [(f"synthetic-{f}", _texts(make_log(tp=4, failure=f, colours=True))) for f in FAILURES]
    logs.append(("synthetic-ok-old-format", _texts(make_log(tp=2, fmt="old"))))
    logs.append(("steady", steady_lines(3000, tp=4)))
    return logs


def _by_line(rules: RuleSet, world: int | None, texts: list[str]) -> list[Milestone]:
    eng = MilestoneEngine(rules, world)
    out = [m for i, t in enumerate(texts) for m in eng.feed(t, i + 1)]
    return out + eng.flush()


def _in_batches(rules: RuleSet, world: int | None, texts: list[str], rnd: random.Random) -> list[Milestone]:
    eng = MilestoneEngine(rules, world)
    out: list[Milestone] = []
    at = 0
    while at < len(texts):
        n = rnd.choice([1, 2, 7, 64, 1000, len(texts)])
        out += eng.feed_many(texts[at : at + n], at + 1)
        at += n
        if rnd.random() < 0.1:  # the watcher's idle release between batches
            out += eng.release_ready()
    return out + eng.flush()


def _by_line_with_releases(
    rules: RuleSet, world: int | None, texts: list[str], rnd: random.Random
) -> list[Milestone]:
    """Line by line, with ``release_ready`` at the same points as ``_in_batches`` (same random choices)."""
    eng = MilestoneEngine(rules, world)
    out: list[Milestone] = []
    at = 0
    while at < len(texts):
        n = rnd.choice([1, 2, 7, 64, 1000, len(texts)])
        for i, t in enumerate(texts[at : at + n]):
            out += eng.feed(t, at + i + 1)
        at += n
        if rnd.random() < 0.1:
            out += eng.release_ready()
    return out + eng.flush()


LOGS = _logs()


@pytest.mark.parametrize("world", [None, 2, 4])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize(("name", "texts"), LOGS, ids=[n for n, _ in LOGS])
def test_feed_many_equals_feed_line_by_line(
    name: str, texts: list[str], world: int | None, extra: bool
) -> None:
    rules = load_rules(extra=EXTRA_RULES if extra else None)
    expected = _by_line(rules, world, texts)
    assert expected or name == "steady"  # the logs do hold milestones: the comparison means something
    assert [m.to_dict() for m in _in_batches(rules, world, texts, random.Random(1))] == [
        m.to_dict() for m in expected
    ]
    for seed in range(3):
        got = _in_batches(rules, world, texts, random.Random(seed))
        want = _by_line_with_releases(rules, world, texts, random.Random(seed))
        assert [m.to_dict() for m in got] == [m.to_dict() for m in want]


def test_prefilter_skips_most_steady_lines_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    pre = MilestoneEngine(load_rules())._prefilter
    assert pre.usable
    texts = steady_lines(5000, tp=8)
    hits = pre.hits_of(pre.keys(texts))
    assert len(pre.memo) < 50  # digits removed, a steady log is a few dozen line shapes
    # Only lines some rule may match: "Added request" holds a gate word, but no rule's literal.
    assert len(hits) < len(texts) / 20
    assert hits == [i for i, t in enumerate(texts) if pre.rules_for(pre.key(t).decode()) is not None]
    assert set(hits) >= {i for i, t in enumerate(texts) if pre.gate.candidates(t)}  # never a false negative
    monkeypatch.setattr("agent.milestones.logline.MEMO_MAX", 10)
    free = [f"free text {w} number {i}" for i, w in enumerate(["a", "b", "c", "d", "e", "f"] * 5)]
    assert pre.hits_of(pre.keys(free)) == [] and len(pre.memo) <= len(set(map(pre.key, free))) + 10
    assert pre.hits_of(pre.keys(["x\ny", "z"])) == []  # a text holding a newline: keyed line by line


def test_prefilter_unusable_when_a_gate_word_has_a_digit() -> None:
    rules = load_rules(extra=[{"name": "n", "kind": "warning", "words": ["nccl2"], "regex": "nccl2"}])
    assert not Prefilter(Gate(rules)).usable
    eng = MilestoneEngine(rules)
    texts = ["x nccl2 y", "x nccl y", "nccl2"]
    assert [m.to_dict() for m in eng.feed_many(texts, 1) + eng.flush()] == [
        m.to_dict() for m in _by_line(rules, None, texts)
    ]


def test_a_literal_with_a_digit_is_confirmed_line_by_line() -> None:
    """``100% Completed`` holds digits: lines of one shape (``50%``/``100%``) are answered one by one."""
    pre = MilestoneEngine(load_rules())._prefilter
    done = "Loading safetensors checkpoint shards: 100% Completed | 4/4 [00:04<00:00, 1.02it/s]"
    half = "Loading safetensors checkpoint shards: 50% Completed | 2/4 [00:02<00:02, 1.02it/s]"
    for texts in ([half, done], [done, half]):
        pre.memo.clear()
        assert pre.hits_of(pre.keys(texts)) == [
            0,
            1,
        ]  # both may match: the shape alone cannot tell them apart
        assert [r.name for r in pre.rules_for(done) or []] == ["weight_shards_done"]
        assert "weight_shards_done" not in [r.name for r in pre.rules_for(half) or []]
