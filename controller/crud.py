"""Every write to the database: data functions with a keyword-only ``tx`` (the store's writer transaction).

What to write for journal and lifecycle events is decided by the pure ingest.py; the functions here carry
its plans out.  INSERTs are compiled (once per column set) from the SQLModel tables of models.py, so a
column the schema lacks fails loudly; rare rows are built as table models, with their defaults.
"""

from __future__ import annotations

import json
import sqlite3
import time
from functools import cache
from typing import Any

from sqlalchemy import insert
from sqlalchemy.dialects import sqlite
from sqlmodel import SQLModel

from agent.runs.outdir import overlap
from controller import alerts, ingest, queries, shard_store
from controller.alerts import AlertDraft, AlertPolicy
from controller.bus import BusEvent, make_cursor
from controller.errors import Conflict, NotFound
from controller.lifecycle import RunEvent
from controller.logblocks import Block
from controller.models import Alert, Event, Host, HostCreate, LogBlock, Milestone, Outbox, Problem, Run
from controller.settings import Settings
from controller.store import FEED_KINDS, Tx

#: Columns of the rows written once per journal event or log block, in their tables' order.
EVENT_COLUMNS = ("run_id", "seq", "kind", "at", "data_json", "log_mark")
LOG_BLOCK_COLUMNS = ("run_id", "offset", "end_offset", "text", "offsets")
MILESTONE_COLUMNS = ("run_id", "seq", "kind", "at", "line", "rank", "fields_json", "text")
PROBLEM_COLUMNS = ("run_id", "seq", "idx", "code", "file", "message", "at")


@cache
def _insert_sql(model: type[SQLModel], columns: tuple[str, ...], or_ignore: bool) -> str:
    """INSERT of these columns (in the table's order) of a table model, compiled from its SQLModel table."""
    table = model.__table__  # type: ignore[attr-defined]
    order = tuple(col.name for col in table.columns if col.name in columns)
    if order != columns:
        unknown = sorted(set(columns) - set(order))
        raise KeyError(f"{model.__name__}: no column(s) {unknown}" if unknown else f"{columns} != {order}")
    stmt = insert(table).prefix_with("OR IGNORE") if or_ignore else insert(table)
    return str(stmt.compile(dialect=sqlite.dialect(), column_keys=list(columns)))


def _insert(tx: Tx, row: SQLModel) -> sqlite3.Cursor:
    """Insert one table-model row, its defaults included (None columns are left to the table)."""
    values = row.model_dump()
    table = type(row).__table__  # type: ignore[attr-defined]
    columns = tuple(col.name for col in table.columns if values.get(col.name) is not None)
    return tx.conn.execute(_insert_sql(type(row), columns, False), tuple(values[c] for c in columns))


# ----------------------------------------------------------------------------------------------- the feed


def add_event(
    *, tx: Tx, run_id: str | None, seq: int | None, kind: str, data: dict[str, Any], at: float
) -> bool:
    """Insert an event (ignored when (run, seq) exists); FEED_KINDS are published after commit."""
    cur = tx.conn.execute(
        _insert_sql(Event, EVENT_COLUMNS, True), (run_id, seq, kind, at, json.dumps(data), tx.last_log_id)
    )
    if cur.rowcount == 0:
        return False
    tx.last_event_id = int(cur.lastrowid or 0)
    if kind in FEED_KINDS:
        tx.events.append(BusEvent(kind, run_id, data, make_cursor(tx.last_event_id, tx.last_log_id)))  # type: ignore[arg-type]
    return True


def add_log_block(*, tx: Tx, run_id: str, block: Block) -> int:
    """Store a block of log lines as one row, idempotently: only its lines at or past the run's stored log
    offset are new (a replayed or overlapping block adds nothing twice); advance that offset; returns how
    many lines were new."""
    row = tx.conn.execute("SELECT log_offset FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        return 0
    new = block.trim(row[0])
    if new is None:
        return 0
    cur = tx.conn.execute(
        _insert_sql(LogBlock, LOG_BLOCK_COLUMNS, True),
        (run_id, new.offset, new.next_offset, new.text, new.blob()),
    )
    if cur.rowcount == 0:
        return 0
    tx.conn.execute("UPDATE runs SET log_offset = max(log_offset, ?) WHERE id = ?", (new.next_offset, run_id))
    tx.last_log_id = int(cur.lastrowid or 0)
    tx.events.append(BusEvent("log", run_id, new.to_data(), make_cursor(tx.last_event_id, tx.last_log_id)))
    return new.count


def publish_run(*, tx: Tx, run_id: str) -> None:
    """Record + publish the run's current public shape (a shard's job: its sharded run's too)."""
    run = queries.get_run_public(tx.conn, run_id)
    add_event(tx=tx, run_id=run_id, seq=None, kind="run", data=run.model_dump(), at=tx.now)
    for parent in shard_store.parents_of(tx.conn, run_id):
        if shard_store.aggregate(tx.conn, parent, tx.now, run_id):
            publish_run(tx=tx, run_id=parent)


def publish_host(*, tx: Tx, name: str) -> None:
    """Record + publish the host's current public shape."""
    host = queries.get_host(tx.conn, name)
    add_event(tx=tx, run_id=None, seq=None, kind="host", data=host.model_dump(), at=tx.now)


def publish_alert(*, tx: Tx, alert_id: int) -> None:
    """Record + publish an alert's current public shape."""
    alert = queries.get_alert(tx.conn, alert_id)
    add_event(tx=tx, run_id=alert.run_id, seq=None, kind="alert", data=alert.model_dump(), at=tx.now)


# ----------------------------------------------------------------------------------------------- runs


def insert_run(
    *,
    tx: Tx,
    run_id: str,
    name: str,
    host: str,
    backend: str,
    model: str | None,
    spec_json: str,
    resumed_from: str | None = None,
    shards: int | None = None,
    shard_of: str | None = None,
    shard_index: int | None = None,
) -> None:
    """A new run, ``pending`` (``resumed_from``: the run whose output directory it carries on; ``shards``:
    a sharded run; ``shard_of``/``shard_index``: one shard's job).

    A run is resumed once: Conflict naming the newer attempt when ``resumed_from`` already was (a shard's
    jobs are held to that by controller/shardruns.py: an array job's tasks resume from one job)."""
    if resumed_from is not None and shard_of is None and (newer := queries.resumed_by(tx.conn, resumed_from)):
        raise Conflict(f"run {resumed_from} was already resumed as {newer[-1]}: resume {newer[-1]} instead")
    run = Run(
        id=run_id, name=name, host=host, backend=backend, model=model, spec_json=spec_json, created_at=tx.now,
        resumed_from=resumed_from, shards=shards, shard_of=shard_of, shard_index=shard_index,
    )  # fmt: skip
    _insert(tx, run)
    publish_run(tx=tx, run_id=run_id)


def ensure_output_dir_free(*, tx: Tx, hosts: list[str], output_dir: str | None) -> None:
    """Conflict when a job on one of ``hosts`` that has not ended writes into ``output_dir`` (or a directory
    holding it or held by it); called in the transaction that inserts the run, so one of two wins."""
    if not output_dir:
        return
    for job in queries.output_dir_holders(tx.conn, hosts):
        if job["output_dir"] and overlap(output_dir, job["output_dir"]):
            raise Conflict(
                f"output_dir {output_dir!r} on host {job['host']} is being written by run "
                f"{job['shard_of'] or job['id']} ({job['state']}): wait for it to end or choose another"
                " output_dir"
            )


def discard_run(*, tx: Tx, run_id: str) -> None:
    """Forget a run its agent refused before it started (the refusal is the caller's error): its row and
    the feed events that showed it."""
    tx.conn.execute("DELETE FROM events WHERE run_id=?", (run_id,))
    tx.conn.execute("DELETE FROM runs WHERE id=?", (run_id,))


def set_pid(*, tx: Tx, run_id: str, pid: int | None, scheduler_job: str | None = None) -> None:
    """The job's pid (or Slurm job id) as the agent reported it at launch."""
    tx.conn.execute("UPDATE runs SET pid=?, scheduler_job=? WHERE id=?", (pid, scheduler_job, run_id))


_SET_STATE = (
    "UPDATE runs SET state=:state, started_at=coalesce(started_at, :started_at),"
    " ended_at=coalesce(ended_at, :ended_at), exit_json=coalesce(:exit_json, exit_json),"
    " failure_reason=coalesce(failure_reason, :failure_reason) WHERE id=:id"
)


def transition(
    *,
    tx: Tx,
    run_id: str,
    event: RunEvent,
    policy: AlertPolicy,
    at: float | None = None,
    exit: dict[str, Any] | None = None,
    reason: str | None = None,
) -> str | None:
    """Move a run through the lifecycle table; returns the new state, or None when not allowed."""
    row = tx.conn.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        return None
    change = ingest.plan_transition(dict(row), event, at=at or tx.now, exit=exit, reason=reason)
    if change is None:
        return None
    if change.write:
        cols = {k: getattr(change, k) for k in ("started_at", "ended_at", "exit_json", "failure_reason")}
        tx.conn.execute(_SET_STATE, {**cols, "state": change.state.value, "id": run_id})
        for draft in change.alerts:
            raise_alert(tx=tx, draft=draft, policy=policy)
        publish_run(tx=tx, run_id=run_id)
    return change.state.value


def apply_event_batch(*, tx: Tx, events: list[tuple[str, dict[str, Any]]], policy: AlertPolicy) -> int:
    """Store a batch of journal events of one or more runs (run id, event), each run's in seq order, in this
    one transaction; returns how many were new.  A replay or a duplicate seq is skipped (last_seq)."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for run_id, ev in events:
        by_run.setdefault(run_id, []).append(ev)
    return sum(apply_events(tx=tx, run_id=r, events=evs, policy=policy) for r, evs in by_run.items())


def apply_events(*, tx: Tx, run_id: str, events: list[dict[str, Any]], policy: AlertPolicy) -> int:
    """Store journal events of one run in seq order, the run row read once; returns how many were new."""
    row = tx.conn.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        return 0
    run = dict(row)
    plan = ingest.plan_events(run, events, tx.now)
    cols: dict[str, Any] = {}  # the run's progress columns: set once, with last_seq, not once per event
    for effect in plan.effects:
        match effect:
            case ingest.SetProgress(fields, at, interval_s):
                cols.update(progress_json=json.dumps(fields), last_progress_at=at)
                cols.update(progress_interval_s=interval_s, last_milestone="progress")
            case ingest.SetLastMilestone(kind):
                cols["last_milestone"] = kind
            case ingest.SetCheckedAt(at):
                cols["last_check_at"] = at
            case ingest.Transition():
                _set_run(tx, run_id, cols)  # the transition reads the row: bring it up to date first
                cols = {}
                _apply(tx, run, effect, policy)
            case _:
                _apply(tx, run, effect, policy)
    _set_run(tx, run_id, cols, last_seq=plan.last_seq)
    said = [(e.kind, e.fields) for e in plan.effects if isinstance(e, ingest.StoreMilestone)]
    if said and run["shard_of"] and shard_store.has_tasks(tx.conn, run_id):
        # an array job: each task's own shard row, and an alert for a task that failed (the others go on)
        for task in shard_store.note_tasks(tx.conn, run_id, said):
            for draft in alerts.rules_for_state(task, "failed", task["reason"]):
                raise_alert(tx=tx, draft=draft, policy=policy)
    if plan.run_changed:
        publish_run(tx=tx, run_id=run_id)
    return plan.applied


def _set_run(tx: Tx, run_id: str, cols: dict[str, Any], last_seq: int | None = None) -> None:
    sets = [f"{name}=:{name}" for name in cols]  # names come from the code above, never from data
    if last_seq is not None:
        sets.append("last_seq=max(last_seq, :last_seq)")
    if sets:
        tx.conn.execute(
            f"UPDATE runs SET {', '.join(sets)} WHERE id=:id", {**cols, "last_seq": last_seq, "id": run_id}
        )


def _apply(tx: Tx, run: dict[str, Any], effect: ingest.Effect, policy: AlertPolicy) -> None:
    run_id = run["id"]
    match effect:
        case ingest.Record(seq, kind, data, at):
            add_event(tx=tx, run_id=run_id, seq=seq, kind=kind, data=data, at=at)
        case ingest.StoreMilestone(seq, kind, at, line, rank, fields, text):
            tx.conn.execute(
                _insert_sql(Milestone, MILESTONE_COLUMNS, True),
                (run_id, seq, kind, at, line, rank, json.dumps(fields), text),
            )
        case ingest.StoreProblem(seq, idx, code, file, message, at):
            tx.conn.execute(
                _insert_sql(Problem, PROBLEM_COLUMNS, True), (run_id, seq, idx, code, file, message, at)
            )
        case ingest.Transition(event, at, exit, reason):
            transition(tx=tx, run_id=run_id, event=event, policy=policy, at=at, exit=exit, reason=reason)
        case ingest.RaiseAlert(draft):
            raise_alert(tx=tx, draft=draft, policy=policy)


# ----------------------------------------------------------------------------------------------- hosts


def insert_host(*, tx: Tx, host: HostCreate) -> None:
    """A new host; Conflict when the name exists."""
    if tx.conn.execute("SELECT 1 FROM hosts WHERE name=?", (host.name,)).fetchone():
        raise Conflict(f"host {host.name!r} already exists")
    _insert(tx, Host(**host.to_row(), created_at=tx.now))
    publish_host(tx=tx, name=host.name)


def delete_host(*, tx: Tx, name: str) -> None:
    """Forget a host; Conflict while it has runs that are not finished."""
    busy = tx.conn.execute(
        f"SELECT id FROM runs WHERE host=? AND state NOT IN {queries.TERMINAL_SQL}", (name,)
    ).fetchall()
    if busy:
        raise Conflict(f"host {name!r} has unfinished runs: {', '.join(r[0] for r in busy)}")
    tx.conn.execute("DELETE FROM hosts WHERE name=?", (name,))


def host_up(
    *, tx: Tx, name: str, agent_version: str | None, fingerprint: str | None, gpus: list[Any] | None
) -> None:
    """The host answered: reachable, its agent version, key fingerprint and GPUs (None: keep the old)."""
    tx.conn.execute(
        "UPDATE hosts SET reachable=1, last_seen=?, unreachable_since=NULL, agent_version=?, last_error=NULL,"
        " fingerprint=coalesce(?, fingerprint), gpus_json=coalesce(?, gpus_json) WHERE name=?",
        (tx.now, agent_version, fingerprint or None, None if gpus is None else json.dumps(gpus), name),
    )
    publish_host(tx=tx, name=name)


def host_seen(*, tx: Tx, name: str) -> None:
    """The link to the host is still up."""
    tx.conn.execute("UPDATE hosts SET last_seen=? WHERE name=?", (tx.now, name))


def host_unreachable(*, tx: Tx, name: str, reason: str) -> bool:
    """Mark the host unreachable with the reason; False when there is no such host."""
    row = tx.conn.execute("SELECT reachable FROM hosts WHERE name=?", (name,)).fetchone()
    if row is None:
        return False
    tx.conn.execute(
        "UPDATE hosts SET reachable=0, last_error=?, unreachable_since=coalesce(unreachable_since, ?)"
        " WHERE name=?",
        (reason, tx.now, name),
    )
    if row[0] != 0:
        publish_host(tx=tx, name=name)
    return True


def host_down(*, tx: Tx, name: str, reason: str, policy: AlertPolicy) -> None:
    """The link dropped: the host is unreachable and its starting/running runs become ``unknown``."""
    if not host_unreachable(tx=tx, name=name, reason=reason):
        return
    for (run_id,) in tx.conn.execute(
        "SELECT id FROM runs WHERE host=? AND state IN ('starting','running') AND shards IS NULL", (name,)
    ).fetchall():
        transition(tx=tx, run_id=run_id, event=RunEvent.LINK_DOWN, policy=policy)


# ----------------------------------------------------------------------------------------------- alerts


def raise_alert(*, tx: Tx, draft: AlertDraft, policy: AlertPolicy) -> int | None:
    """Store ``draft`` unless its key (run, rule and problem; or host and rule) fired within the cooldown;
    returns the new alert id."""
    recent = tx.conn.execute(
        "SELECT 1 FROM alerts WHERE dedupe_key=? AND created_at > ? LIMIT 1",
        (draft.dedupe_key, tx.now - policy.cooldown_s),
    ).fetchone()
    if recent:
        return None
    alert = Alert(
        run_id=draft.run_id,
        host=draft.host,
        rule=draft.rule,
        severity=draft.severity,
        message=draft.message,
        created_at=tx.now,
        dedupe_key=draft.dedupe_key,
    )
    alert_id = int(_insert(tx, alert).lastrowid or 0)
    if policy.deliver:
        _insert(tx, Outbox(alert_id=alert_id, next_attempt_at=tx.now))
    publish_alert(tx=tx, alert_id=alert_id)
    return alert_id


def sweep(*, tx: Tx, policy: AlertPolicy, settings: Settings, only_hosts: list[str] | None) -> None:
    """Alerts on absence: hosts unreachable too long, running runs whose progress is overdue."""
    now = time.time()
    for name, since in tx.conn.execute(
        "SELECT name, unreachable_since FROM hosts WHERE reachable=0"
    ).fetchall():
        if only_hosts is not None and name not in only_hosts:
            continue
        draft = alerts.host_unreachable(name, since, now, settings.unreachable_minutes)
        if draft:
            raise_alert(tx=tx, draft=draft, policy=policy)
    for row in tx.conn.execute("SELECT * FROM runs WHERE state='running' AND shards IS NULL").fetchall():
        draft = alerts.stall(dict(row), now, settings.stall_factor, settings.stall_min_s)
        if draft:
            raise_alert(tx=tx, draft=draft, policy=policy)


def ack_alert(*, tx: Tx, alert_id: int) -> None:
    """Mark an alert acknowledged; NotFound names it."""
    if tx.conn.execute("UPDATE alerts SET acked=1 WHERE id=?", (alert_id,)).rowcount == 0:
        raise NotFound(f"no alert {alert_id}")
    publish_alert(tx=tx, alert_id=alert_id)


def mute_alert(*, tx: Tx, alert_id: int) -> None:
    """Mute an alert and drop its pending delivery; NotFound names it."""
    if tx.conn.execute("UPDATE alerts SET muted=1 WHERE id=?", (alert_id,)).rowcount == 0:
        raise NotFound(f"no alert {alert_id}")
    tx.conn.execute("UPDATE outbox SET done=1 WHERE alert_id=? AND done=0", (alert_id,))
    publish_alert(tx=tx, alert_id=alert_id)


def claim_outbox(*, tx: Tx, outbox_id: int, now: float, lease_s: float = 60.0) -> bool:
    """Take a due outbox row for one delivery attempt (another process may poll the same outbox)."""
    cur = tx.conn.execute(
        "UPDATE outbox SET next_attempt_at=? WHERE id=? AND done=0 AND next_attempt_at <= ?",
        (now + lease_s, outbox_id, now),
    )
    return cur.rowcount == 1


def outbox_delivered(*, tx: Tx, row: dict[str, Any]) -> None:
    """The channel took the alert."""
    tx.conn.execute("UPDATE outbox SET done=1, attempts=attempts+1 WHERE id=?", (row["id"],))
    tx.conn.execute("UPDATE alerts SET delivered=1 WHERE id=?", (row["alert_id"],))
    publish_alert(tx=tx, alert_id=row["alert_id"])


def outbox_failed(*, tx: Tx, row: dict[str, Any], delay_s: float, error: str | None) -> None:
    """The channel refused: try again after ``delay_s``."""
    tx.conn.execute(
        "UPDATE outbox SET attempts=?, next_attempt_at=?, last_error=? WHERE id=?",
        (row["attempts"] + 1, tx.now + delay_s, error, row["id"]),
    )


def gc_logs(*, tx: Tx, before: float) -> dict[str, int]:
    """Drop the stored log lines of runs that ended before ``before``; their milestones, verdicts, problems,
    alerts and specs stay.  Returns how many runs were touched and how many lines went."""
    ids = queries.ended_before(tx.conn, before)
    runs = lines = 0
    for i in range(0, len(ids), 500):  # SQLite caps the number of bound parameters
        chunk = ids[i : i + 500]
        marks = ",".join("?" * len(chunk))
        # a block holds newline-joined lines: its line count is its newlines + 1
        n, r = tx.conn.execute(
            "SELECT coalesce(sum(length(text) - length(replace(text, char(10), '')) + 1), 0),"
            f" count(DISTINCT run_id) FROM log_blocks WHERE run_id IN ({marks})",
            chunk,
        ).fetchone()
        tx.conn.execute(f"DELETE FROM log_blocks WHERE run_id IN ({marks})", chunk)
        lines += int(n)
        runs += int(r)
    return {"runs": runs, "lines": lines}
