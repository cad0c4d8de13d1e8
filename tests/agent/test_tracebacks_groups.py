"""The engine's two pure helpers on their own: a traceback followed line by line, rank groups closing."""

from __future__ import annotations

import pytest

from agent.milestones import tracebacks
from agent.milestones.groups import RankGroups
from agent.milestones.milestone import Milestone

# (message, step) in order: one traceback with a chained exception, then a line of something else
CHAINED = [
    ('  File "/x/worker.py", line 12, in load', "taken"),
    ("    model = load()", "taken"),
    ("RuntimeError: CUDA out of memory", "taken"),
    ("", "taken"),
    ("The above exception was the direct cause of the following exception:", "taken"),
    ("", "taken"),
    ("Traceback (most recent call last):", "taken"),
    ('  File "/x/engine.py", line 80, in run', "taken"),
    ("EngineDead: Engine core initialization failed", "taken"),
    ("INFO something else entirely", "ended"),
]


def test_a_chained_traceback_is_followed_to_its_last_exception_and_ends_before_the_next_line() -> None:
    tr = tracebacks.opened("Traceback (most recent call last):", 5, 3, "Worker_TP3 pid=7")
    assert tr is not None and (tr.line, tr.rank, tr.indent) == (5, 3, 0)
    for i, (message, step) in enumerate(CHAINED, start=6):
        assert tracebacks.take(tr, message, f"(Worker_TP3 pid=7) {message}", i) == step, message
    assert [e[:2] for e in tr.excs] == [
        ["RuntimeError", "CUDA out of memory"],
        ["EngineDead", "Engine core initialization failed"],
    ]
    fields, text = tracebacks.summary(tr)
    assert fields["frames"] == ["worker.py:12 in load", "engine.py:80 in run"]
    assert fields["chain"] == ["RuntimeError", "EngineDead"]
    assert fields["lines"] == 8  # the blank and "direct cause" lines right after an exception are not counted
    assert text == "(Worker_TP3 pid=7) EngineDead: Engine core initialization failed"


def test_an_indented_traceback_and_one_without_an_exception_line() -> None:
    assert tracebacks.opened("no traceback here", 1, None, "") is None
    tr = tracebacks.opened("    Traceback (most recent call last):", 1, None, "[server] Worker pid=9")
    assert tr is not None and tr.indent == 4
    assert tracebacks.take(tr, '      File "a.py", line 1', "", 2) == "taken"
    assert tr.frames == ["a.py:1"]  # the record's own indentation is not the frame's
    fields, text = tracebacks.summary(tr)
    # no exception line to show: the Traceback line, tagged with the process of a two-process job
    assert fields["chain"] == [] and text == "[server] Traceback (most recent call last):"


def test_a_traceback_is_full_at_its_line_limit() -> None:
    tr = tracebacks.opened("Traceback (most recent call last):", 1, None, "")
    assert tr is not None
    steps = [
        tracebacks.take(tr, f"    frame line {i}", "", i)
        for i in range(2, tracebacks.MAX_TRACEBACK_LINES + 1)
    ]
    assert steps[:-1] == ["taken"] * (len(steps) - 1) and steps[-1] == "full"


def _ms(line: int, **fields: object) -> Milestone:
    return Milestone("weights_loaded", line, None, dict(fields), f"line {line}")


@pytest.mark.parametrize(
    ("joins", "world", "closed_after"),
    [
        # every rank of a known world: closed by the last one
        ([("(W0 pid=1)", 0), ("(W1 pid=2)", 1)], 2, [[], [([0, 1], 2)]]),
        # the same process again: the open group closes with what it had, a new one opens
        ([("(W0 pid=1)", 0), ("(W0 pid=1)", 0)], 4, [[], [([0], 1)]]),
        # no world known: nothing closes on count
        ([("(W0 pid=1)", 0), ("(W1 pid=2)", 1), ("(W2 pid=3)", 2)], None, [[], [], []]),
        # lines with no prefix never count as "the same process again"
        ([("", None), ("", None)], 2, [[], [([0, 1], 2)]]),
    ],
)
def test_rank_groups_close_on_a_full_world_or_a_repeat(
    joins: list[tuple[str, int | None]], world: int | None, closed_after: list[list[tuple[list[int], int]]]
) -> None:
    groups = RankGroups()
    for i, ((proc, rank), want) in enumerate(zip(joins, closed_after, strict=True), start=1):
        out = groups.join("weights", _ms(i, gib=1.5), proc, rank, world)
        assert [(m.fields["ranks"], m.fields["processes"]) for m in out] == want
        assert all(m.rank is None and m.line == 1 and m.fields["gib"] == 1.5 for m in out)


def test_unprefixed_lines_of_a_whole_world_infer_its_ranks() -> None:
    groups = RankGroups()
    groups.join("inj", _ms(1), "", None, 2)
    (closed,) = groups.join("inj", _ms(2), "", None, 2)
    assert closed.fields["ranks"] == [0, 1] and closed.fields["ranks_inferred"] is True


def test_rank_groups_expire_snapshot_and_restore() -> None:
    groups = RankGroups()
    groups.join("a", _ms(10), "(W0 pid=1)", 0, 8)
    groups.join("b", _ms(300), "(W0 pid=1)", 0, 8)
    again = RankGroups()
    again.restore([*groups.snapshot(), {"key": "broken"}])  # another version's entry is skipped
    assert set(again.open) == {"a", "b"}
    (expired,) = again.expire(311, 200, 8)
    assert expired.line == 10 and set(again.open) == {"b"}
    (rest,) = again.close_all(8)
    assert rest.line == 300 and rest.fields["ranks"] == [0] and again.open == {}
