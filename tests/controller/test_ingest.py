"""Case tables for the pure ingest (controller/ingest.py): journal and lifecycle events in, effects out."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from controller.alerts import AlertDraft
from controller.ingest import (
    Plan,
    RaiseAlert,
    Record,
    SetCheckedAt,
    SetLastMilestone,
    SetProgress,
    StateChange,
    StoreMilestone,
    StoreProblem,
    Transition,
    plan_events,
    plan_transition,
)
from controller.lifecycle import RunEvent, RunState

NOW = 5000.0


def run(**over: Any) -> dict[str, Any]:
    """A stored run row, running, nothing applied yet."""
    base: dict[str, Any] = {
        "id": "r-1",
        "name": "llama",
        "host": "gpu1",
        "state": "running",
        "last_seq": 0,
        "last_progress_at": None,
        "progress_interval_s": None,
        "spec_json": json.dumps({"on_shape_failure": "alert"}),
    }
    return {**base, **over}


def ms(seq: int, kind: str, ts: float | None = None, **fields: Any) -> dict[str, Any]:
    return {"seq": seq, "ts": ts, "type": "milestone", "kind": kind, "line": seq, "rank": None,
            "fields": fields, "text": kind}  # fmt: skip


def check(seq: int, ok: bool, *codes: str) -> dict[str, Any]:
    problems = [{"code": c, "file": "hs_0.safetensors", "message": c} for c in codes]
    return {"seq": seq, "ts": 10.0, "type": "check", "file": "hs_0.safetensors", "ok": ok, "format": "st",
            "problems": problems}  # fmt: skip


def milestone_effects(seq: int, kind: str, at: float, **fields: Any) -> list[Any]:
    data = {"seq": seq, "kind": kind, "at": at, "line": seq, "rank": None, "fields": fields, "text": kind}
    return [StoreMilestone(seq, kind, at, seq, None, fields, kind), Record(seq, "milestone", data, at)]


SHAPE_ALERT = AlertDraft(
    "shape_check_failed", "critical", "llama: shape check failed: hidden_dim_lost", "r-1", "gpu1"
)
CHECK_ALERT = AlertDraft(
    "shape_check_failed",
    "critical",
    "llama: shape check failed on hs_0.safetensors: all_zero: all_zero",
    "r-1",
    "gpu1",
    "all_zero",
)

CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]], Plan]] = [
    ("nothing", run(), [], Plan([], 0, False)),
    (
        "a milestone; ts missing: now",
        run(),
        [ms(1, "weights_loaded")],
        Plan([*milestone_effects(1, "weights_loaded", NOW), SetLastMilestone("weights_loaded")], 1, True),
    ),
    ("replayed seqs are skipped", run(last_seq=3), [ms(2, "x"), ms(3, "y")], Plan([], 3, False)),
    (
        "a gap is applied anyway",
        run(last_seq=1),
        [ms(3, "engine_ready", 7.0)],
        Plan([*milestone_effects(3, "engine_ready", 7.0), SetLastMilestone("engine_ready")], 3, True),
    ),
    (
        "progress: first interval, then smoothed 0.7/0.3",
        run(last_progress_at=100.0),
        [ms(1, "progress", 110.0, samples_done=1), ms(2, "progress", 130.0, samples_done=2)],
        Plan(
            [
                *milestone_effects(1, "progress", 110.0, samples_done=1),
                SetProgress({"samples_done": 1}, 110.0, 10.0),
                *milestone_effects(2, "progress", 130.0, samples_done=2),
                SetProgress({"samples_done": 2}, 130.0, 0.7 * 10.0 + 0.3 * 20.0),
            ],
            2,
            True,
        ),
    ),
    (
        "a failed shape milestone alerts",
        run(),
        [ms(1, "shape_check_failed", 9.0, message="hidden_dim_lost")],
        Plan(
            [
                *milestone_effects(1, "shape_check_failed", 9.0, message="hidden_dim_lost"),
                SetLastMilestone("shape_check_failed"),
                RaiseAlert(SHAPE_ALERT),
            ],
            1,
            True,
        ),
    ),
    (
        "a failed check: problems, record, alert; with on_shape_failure=stop too (the agent stops)",
        run(spec_json=json.dumps({"on_shape_failure": "stop"})),
        [check(1, False, "all_zero"), check(2, False, "all_zero")],
        Plan(
            [
                StoreProblem(1, 0, "all_zero", "hs_0.safetensors", "all_zero", 10.0),
                Record(
                    1,
                    "check",
                    {
                        "seq": 1,
                        "at": 10.0,
                        "file": "hs_0.safetensors",
                        "ok": False,
                        "format": "st",
                        "problems": check(1, False, "all_zero")["problems"],
                    },
                    10.0,
                ),
                SetCheckedAt(10.0),
                RaiseAlert(CHECK_ALERT),
                StoreProblem(2, 0, "all_zero", "hs_0.safetensors", "all_zero", 10.0),
                Record(
                    2,
                    "check",
                    {
                        "seq": 2,
                        "at": 10.0,
                        "file": "hs_0.safetensors",
                        "ok": False,
                        "format": "st",
                        "problems": check(2, False, "all_zero")["problems"],
                    },
                    10.0,
                ),
                SetCheckedAt(10.0),
                RaiseAlert(CHECK_ALERT),
            ],
            2,
            False,
        ),
    ),
    (
        "a duplicate seq within a batch is applied once",
        run(last_seq=1),
        [ms(2, "engine_ready", 7.0), ms(2, "engine_ready", 7.0), ms(1, "x")],
        Plan([*milestone_effects(2, "engine_ready", 7.0), SetLastMilestone("engine_ready")], 2, True, 1),
    ),
    (
        "a passed check: a record only",
        run(),
        [check(1, True)],
        Plan(
            [
                Record(
                    1,
                    "check",
                    {
                        "seq": 1,
                        "at": 10.0,
                        "file": "hs_0.safetensors",
                        "ok": True,
                        "format": "st",
                        "problems": [],
                    },
                    10.0,
                ),
                SetCheckedAt(10.0),
            ],
            1,
            False,
        ),
    ),
    (
        "a final state: record + transition, no event alerts (the transition brings them)",
        run(),
        [{"seq": 1, "ts": 20.0, "type": "state", "state": "failed", "exit": {"code": 1}, "reason": "oom"}],
        Plan(
            [
                Record(
                    1,
                    "state",
                    {"seq": 1, "state": "failed", "at": 20.0, "exit": {"code": 1}, "reason": "oom"},
                    20.0,
                ),
                Transition(RunEvent.JOB_FAILED, 20.0, {"code": 1}, "oom"),
            ],
            1,
            False,
        ),
    ),
    (
        "an unknown agent state: recorded, no transition",
        run(),
        [{"seq": 1, "ts": 20.0, "type": "state", "state": "dancing"}],
        Plan(
            [
                Record(
                    1, "state", {"seq": 1, "state": "dancing", "at": 20.0, "exit": None, "reason": None}, 20.0
                )
            ],
            1,
        ),
    ),
    (
        "another journal record is kept for the seq ledger",
        run(),
        [{"seq": 1, "ts": 3.0, "type": "note", "x": 1}],
        Plan(
            [Record(1, "journal", {"seq": 1, "journal": {"seq": 1, "ts": 3.0, "type": "note", "x": 1}}, 3.0)],
            1,
        ),
    ),
]


@pytest.mark.parametrize(("name", "stored", "events", "expected"), CASES, ids=[c[0] for c in CASES])
def test_plan_events(name: str, stored: dict[str, Any], events: list[dict[str, Any]], expected: Plan) -> None:
    plan = plan_events(stored, events, NOW)
    assert plan == replace(expected, applied=plan.applied)
    assert plan.applied == len({e["seq"] for e in events if e["seq"] > stored["last_seq"]})


RUN_FAILED = AlertDraft("run_failed", "error", "llama failed on gpu1: oom", "r-1", "gpu1")
RUN_LOST = AlertDraft("run_lost", "error", "llama lost on gpu1", "r-1", "gpu1")

TRANSITIONS: list[tuple[str, str, RunEvent, dict[str, Any] | None, str | None, StateChange | None]] = [
    ("pending → starting", "pending", RunEvent.LAUNCH, None, None,
     StateChange(RunState.STARTING, write=True)),
    ("starting → running sets started_at", "starting", RunEvent.LAUNCHED, None, None,
     StateChange(RunState.RUNNING, write=True, started_at=50.0)),
    ("same state, nothing new: no write", "running", RunEvent.JOB_RUNNING, None, None,
     StateChange(RunState.RUNNING, write=False)),
    ("failed: ended_at, exit, reason, alert", "running", RunEvent.JOB_FAILED, {"code": 1}, "oom",
     StateChange(RunState.FAILED, write=True, ended_at=50.0, exit_json='{"code": 1}', failure_reason="oom",
                 alerts=[RUN_FAILED])),
    ("lost: alert without a reason", "unknown", RunEvent.JOB_LOST, None, None,
     StateChange(RunState.LOST, write=True, ended_at=50.0, alerts=[RUN_LOST])),
    ("a reason is kept only for failed/lost", "running", RunEvent.JOB_COMPLETED, {"code": 0}, "done",
     StateChange(RunState.COMPLETED, write=True, ended_at=50.0, exit_json='{"code": 0}')),
    ("terminal never moves back", "completed", RunEvent.JOB_RUNNING, None, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "state", "event", "exit", "reason", "expected"), TRANSITIONS, ids=[t[0] for t in TRANSITIONS]
)
def test_plan_transition(
    name: str,
    state: str,
    event: RunEvent,
    exit: dict[str, Any] | None,
    reason: str | None,
    expected: StateChange | None,
) -> None:
    assert plan_transition(run(state=state), event, at=50.0, exit=exit, reason=reason) == expected


def test_progress_keeps_the_last_known_samples_total() -> None:
    """A pipeline's bar without a total (SpecForge's) does not hide the total its job printed before."""
    stored = run(last_seq=1, progress_json=json.dumps({"samples_done": 0, "samples_total": 6}))
    events = [ms(2, "progress", 10.0, samples_done=2, batches_done=1),
              ms(3, "progress", 11.0, samples_total=9), ms(4, "progress", 12.0, samples_done=4)]  # fmt: skip
    got = [e.fields for e in plan_events(stored, events, NOW).effects if isinstance(e, SetProgress)]
    assert got == [
        {"samples_done": 2, "batches_done": 1, "samples_total": 6},
        {"samples_total": 9},
        {"samples_done": 4, "samples_total": 9},
    ]
    # stored fields stay as the job sent them: only the run's latest progress carries the total
    stored_ms = [e.fields for e in plan_events(stored, events, NOW).effects if isinstance(e, StoreMilestone)]
    assert stored_ms[0] == {"samples_done": 2, "batches_done": 1}
    assert [e.fields for e in plan_events(run(), events[:1], NOW).effects if isinstance(e, SetProgress)] == [
        {"samples_done": 2, "batches_done": 1}
    ]
