"""Apply journal events and state changes to the store in one writer transaction: exactly once, in order.

A journal event whose ``seq`` is not above the run's stored ``last_seq`` was already applied (a replay after
reconnect, or another controller process following the same run) and is skipped; UNIQUE(run_id, seq) on
events and milestones is the safety net.  Returns follow-up actions the caller performs over the link.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from controller import alerts, lifecycle
from controller.store import Tx

log = logging.getLogger(__name__)


def transition(
    tx: Tx,
    run_id: str,
    event: lifecycle.RunEvent,
    *,
    at: float | None = None,
    exit: dict[str, Any] | None = None,
    reason: str | None = None,
    cooldown_s: float = 600.0,
    deliver: bool = False,
) -> str | None:
    """Move a run through the lifecycle table; returns the new state, or None when not allowed."""
    row = tx.conn.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        return None
    old = row["state"]
    try:
        new = lifecycle.next_state(old, event)
    except lifecycle.InvalidTransition as exc:
        log.warning("run %s: %s (ignored)", run_id, exc)
        return None
    if new == old and exit is None and reason is None:
        return new
    at = at or tx.now
    sets: list[str] = ["state=?"]
    args: list[Any] = [new.value]
    if new == lifecycle.RunState.RUNNING and row["started_at"] is None:
        sets.append("started_at=?")
        args.append(at)
    if lifecycle.is_terminal(new) and row["ended_at"] is None:
        sets.append("ended_at=?")
        args.append(at)
    if exit is not None:
        sets.append("exit_json=?")
        args.append(json.dumps(exit))
    if reason is not None and new in (lifecycle.RunState.FAILED, lifecycle.RunState.LOST):
        sets.append("failure_reason=coalesce(failure_reason, ?)")
        args.append(str(reason))
    tx.conn.execute(f"UPDATE runs SET {', '.join(sets)} WHERE id=?", (*args, run_id))
    if new != old:
        for draft in alerts.rules_for_state(dict(row), new.value, reason):
            alerts.raise_alert(tx, draft, cooldown_s=cooldown_s, deliver=deliver)
    tx.run_changed(run_id)
    return new.value


def apply_events(
    tx: Tx, run_id: str, events: list[dict[str, Any]], *, cooldown_s: float, deliver: bool
) -> list[str]:
    """Store journal events of one run in seq order; returns actions (``"stop"`` for on_shape_failure)."""
    row = tx.conn.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        return []
    run = dict(row)
    last_seq = run["last_seq"]
    spec = json.loads(run["spec_json"])
    actions: list[str] = []
    changed = False
    for ev in events:
        seq = int(ev.get("seq", 0))
        if seq <= last_seq:
            continue
        if seq != last_seq + 1:
            log.warning("run %s: journal gap, seq %d after %d", run_id, seq, last_seq)
        last_seq = seq
        at = float(ev.get("ts") or tx.now)
        etype = ev.get("type")
        if etype == "milestone":
            changed |= _milestone(tx, run, seq, at, ev)
        elif etype == "check":
            _check(tx, run_id, seq, at, ev)
        elif etype == "state":
            agent_state = str(ev.get("state"))
            tx.add_event(
                run_id,
                seq,
                "state",
                {
                    "seq": seq,
                    "state": agent_state,
                    "at": at,
                    "exit": ev.get("exit"),
                    "reason": ev.get("reason"),
                },
                at,
            )
            try:
                rev = lifecycle.event_for_agent_state(agent_state)
            except ValueError as exc:
                log.warning("run %s: %s", run_id, exc)
            else:
                # Alerts for failed/lost come from transition(); other rules below skip "state".
                transition(
                    tx,
                    run_id,
                    rev,
                    at=at,
                    exit=ev.get("exit"),
                    reason=ev.get("reason"),
                    cooldown_s=cooldown_s,
                    deliver=deliver,
                )
            continue
        else:
            tx.add_event(run_id, seq, "journal", {"seq": seq, "journal": ev}, at)
        for draft in alerts.rules_for_event(run, ev):
            alerts.raise_alert(tx, draft, cooldown_s=cooldown_s, deliver=deliver)
        failed_check = (etype == "check" and ev.get("ok") is False) or (
            etype == "milestone" and ev.get("kind") == "shape_check_failed"
        )
        if failed_check and spec.get("on_shape_failure") == "stop" and "stop" not in actions:
            actions.append("stop")
    tx.conn.execute("UPDATE runs SET last_seq=max(last_seq, ?) WHERE id=?", (last_seq, run_id))
    if changed:
        tx.run_changed(run_id)
    return actions


def _milestone(tx: Tx, run: dict[str, Any], seq: int, at: float, ev: dict[str, Any]) -> bool:
    run_id, kind = run["id"], str(ev.get("kind"))
    fields = ev.get("fields") or {}
    tx.conn.execute(
        "INSERT OR IGNORE INTO milestones(run_id, seq, kind, at, line, rank, fields_json, text)"
        " VALUES (?,?,?,?,?,?,?,?)",
        (run_id, seq, kind, at, ev.get("line"), ev.get("rank"), json.dumps(fields), str(ev.get("text", ""))),
    )
    data = {
        "seq": seq,
        "kind": kind,
        "at": at,
        "line": ev.get("line"),
        "rank": ev.get("rank"),
        "fields": fields,
        "text": str(ev.get("text", "")),
    }
    tx.add_event(run_id, seq, "milestone", data, at)
    if kind == "progress":
        prev = run.get("last_progress_at")
        interval = run.get("progress_interval_s")
        if prev is not None and at > prev:
            gap = at - prev
            interval = gap if interval is None else 0.7 * interval + 0.3 * gap
        tx.conn.execute(
            "UPDATE runs SET progress_json=?, last_progress_at=?, progress_interval_s=?, last_milestone=?"
            " WHERE id=?",
            (json.dumps(fields), at, interval, kind, run_id),
        )
        run["last_progress_at"], run["progress_interval_s"] = at, interval
    else:
        tx.conn.execute("UPDATE runs SET last_milestone=? WHERE id=?", (kind, run_id))
    return True


def _check(tx: Tx, run_id: str, seq: int, at: float, ev: dict[str, Any]) -> None:
    problems = ev.get("problems") or []
    for idx, p in enumerate(problems):
        tx.conn.execute(
            "INSERT OR IGNORE INTO problems(run_id, seq, idx, code, file, message, at)"
            " VALUES (?,?,?,?,?,?,?)",
            (
                run_id,
                seq,
                idx,
                str(p.get("code")),
                str(p.get("file", ev.get("file", ""))),
                str(p.get("message", "")),
                at,
            ),
        )
    data = {
        "seq": seq,
        "at": at,
        "file": ev.get("file"),
        "ok": bool(ev.get("ok")),
        "format": ev.get("format"),
        "problems": problems,
    }
    tx.add_event(run_id, seq, "check", data, at)
