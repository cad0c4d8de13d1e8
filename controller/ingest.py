"""Journal events and lifecycle events → effects, pure: what storing them must do, exactly once, in order.

``plan_events(run, events, now)`` reads a run as stored (``last_seq``, progress timing) and a batch of
journal events from its agent.  An event whose ``seq`` is not above ``last_seq`` was already applied (a
replay after reconnect, a duplicate within the batch, or another controller process following the same
run) and is skipped.  The ``Plan`` lists the effects in order and the new ``last_seq``.  Nothing here
decides to stop a run: on_shape_failure = stop is the agent's decision (agent/runs/watcher.py), and the
controller records what the journal then says (the stop, the final state).
``plan_transition(run, event, …)`` does the same for one lifecycle event: the new state and the columns it
sets.  UNIQUE(run_id, seq) is the safety net.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from controller import alerts, lifecycle
from controller.alerts import AlertDraft
from controller.lifecycle import RunEvent, RunState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    """An ``events`` row: the web's feed and the seq ledger."""

    seq: int
    kind: str
    data: dict[str, Any]
    at: float


@dataclass(frozen=True)
class StoreMilestone:
    """A ``milestones`` row."""

    seq: int
    kind: str
    at: float
    line: Any
    rank: Any
    fields: dict[str, Any]
    text: str


@dataclass(frozen=True)
class StoreProblem:
    """A ``problems`` row: one problem of a shape check."""

    seq: int
    idx: int
    code: str
    file: str
    message: str
    at: float


@dataclass(frozen=True)
class SetProgress:
    """The run's latest progress fields and its smoothed progress interval."""

    fields: dict[str, Any]
    at: float
    interval_s: float | None


@dataclass(frozen=True)
class SetLastMilestone:
    """The run's latest milestone kind (progress sets it too)."""

    kind: str


@dataclass(frozen=True)
class SetCheckedAt:
    """When the run's agent last checked a capture file: the stall rule counts it as progress."""

    at: float


@dataclass(frozen=True)
class Transition:
    """A lifecycle event for the run (planned again against the row when applied: see plan_transition)."""

    event: RunEvent
    at: float
    exit: dict[str, Any] | None
    reason: str | None


@dataclass(frozen=True)
class RaiseAlert:
    """An alert to store (deduplicated within the cooldown when applied)."""

    draft: AlertDraft


Effect = (
    Record
    | StoreMilestone
    | StoreProblem
    | SetProgress
    | SetLastMilestone
    | SetCheckedAt
    | Transition
    | RaiseAlert
)


@dataclass(frozen=True)
class Plan:
    """What applying a batch of journal events does."""

    effects: list[Effect] = field(default_factory=list)
    last_seq: int = 0
    run_changed: bool = False
    applied: int = 0


def plan_events(run: dict[str, Any], events: list[dict[str, Any]], now: float) -> Plan:
    """The effects of one run's journal events, in seq order; already applied ones are skipped."""
    last_seq = int(run["last_seq"])
    progress_at, interval = run.get("last_progress_at"), run.get("progress_interval_s")
    stored = json.loads(run["progress_json"]) if run.get("progress_json") else {}
    total = stored.get("samples_total") if isinstance(stored, dict) else None
    total = total if isinstance(total, int) and not isinstance(total, bool) else None
    effects: list[Effect] = []
    changed = False
    applied = 0
    for ev in events:
        seq = int(ev.get("seq", 0))
        if seq <= last_seq:
            continue
        if seq != last_seq + 1:
            log.warning("run %s: journal gap, seq %d after %d", run["id"], seq, last_seq)
        last_seq = seq
        applied += 1
        at = float(ev.get("ts") or now)
        etype = ev.get("type")
        if etype == "state":
            effects.extend(_state(run["id"], seq, at, ev))
            continue  # alerts for failed/lost come with the transition
        if etype == "milestone":
            kind, fields = str(ev.get("kind")), ev.get("fields") or {}
            milestone = StoreMilestone(
                seq, kind, at, ev.get("line"), ev.get("rank"), fields, str(ev.get("text", ""))
            )
            effects += [milestone, Record(seq, "milestone", asdict(milestone), at)]
            if kind == "progress":
                if progress_at is not None and at > progress_at:
                    gap = at - progress_at
                    interval = gap if interval is None else 0.7 * interval + 0.3 * gap
                progress_at = at
                fields, total = with_total(fields, total)
                effects.append(SetProgress(fields, at, interval))
            else:
                effects.append(SetLastMilestone(kind))
            changed = True
        elif etype == "check":
            effects.extend(_check(seq, at, ev))
            effects.append(SetCheckedAt(at))
        else:
            effects.append(Record(seq, "journal", {"seq": seq, "journal": ev}, at))
        effects.extend(RaiseAlert(d) for d in alerts.rules_for_event(run, ev))
    return Plan(effects, last_seq, changed, applied)


def with_total(fields: dict[str, Any], total: int | None) -> tuple[dict[str, Any], int | None]:
    """Progress fields keeping the last known samples_total when a line lacks one.

    A pipeline's bar (SpecForge's counts batches) knows no sample total, while the job's own line before it
    does: without carrying it, each bar line would hide the total and with it the percentage.
    """
    new = fields.get("samples_total")
    if isinstance(new, int) and not isinstance(new, bool):
        return fields, new
    if total is not None and "samples_total" not in fields:
        return {**fields, "samples_total": total}, total
    return fields, total


def _state(run_id: str, seq: int, at: float, ev: dict[str, Any]) -> list[Effect]:
    agent_state = str(ev.get("state"))
    exit, reason = ev.get("exit"), ev.get("reason")
    data = {"seq": seq, "state": agent_state, "at": at, "exit": exit, "reason": reason}
    out: list[Effect] = [Record(seq, "state", data, at)]
    try:
        event = lifecycle.event_for_agent_state(agent_state)
    except ValueError as exc:
        log.warning("run %s: %s", run_id, exc)
        return out
    out.append(Transition(event, at, exit, reason))
    return out


def _check(seq: int, at: float, ev: dict[str, Any]) -> list[Effect]:
    problems = ev.get("problems") or []
    out: list[Effect] = [
        StoreProblem(
            seq,
            idx,
            str(p.get("code")),
            str(p.get("file", ev.get("file", ""))),
            str(p.get("message", "")),
            at,
        )
        for idx, p in enumerate(problems)
    ]
    data = {
        "seq": seq,
        "at": at,
        "file": ev.get("file"),
        "ok": bool(ev.get("ok")),
        "format": ev.get("format"),
        "problems": problems,
    }
    out.append(Record(seq, "check", data, at))
    return out


@dataclass(frozen=True)
class StateChange:
    """A planned lifecycle step: the new state, the columns to set (None: leave as is), its alerts."""

    state: RunState
    write: bool
    started_at: float | None = None
    ended_at: float | None = None
    exit_json: str | None = None
    failure_reason: str | None = None
    alerts: list[AlertDraft] = field(default_factory=list)


def plan_transition(
    run: dict[str, Any], event: RunEvent, *, at: float, exit: dict[str, Any] | None, reason: str | None
) -> StateChange | None:
    """Move ``run`` through the lifecycle table; None when the table does not allow ``event``."""
    old = run["state"]
    try:
        new = lifecycle.next_state(old, event)
    except lifecycle.InvalidTransition as exc:
        log.warning("run %s: %s (ignored)", run["id"], exc)
        return None
    if new == old and exit is None and reason is None:
        return StateChange(new, write=False)
    return StateChange(
        new,
        write=True,
        started_at=at if new == RunState.RUNNING else None,
        ended_at=at if lifecycle.is_terminal(new) else None,
        exit_json=json.dumps(exit) if exit is not None else None,
        failure_reason=str(reason)
        if reason is not None and new in (RunState.FAILED, RunState.LOST)
        else None,
        alerts=alerts.rules_for_state(run, new.value, reason) if new != old else [],
    )
