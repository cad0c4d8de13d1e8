"""Read-side queries: ``fn(conn, *args)`` → public models; run on reader connections (or inside a write)."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from collections.abc import Iterator
from typing import Any

from controller import shard_store, verdict
from controller.bus import BusEvent, make_cursor, parse_cursor
from controller.errors import NotFound, SpecInvalid
from controller.logblocks import Block
from controller.models import (
    AlertPublic,
    HostPublic,
    MilestonePublic,
    ProblemPublic,
    RunDetail,
    RunPublic,
)
from controller.store import FEED_KINDS

TERMINAL_SQL = "('completed','failed','stopped','lost')"
#: A feed page holds log blocks of about this many characters at most (blocks are up to 512 KiB each).
FEED_LOG_CHARS = 8 << 20
_ERROR_RE = re.compile(r"error|traceback|exception|fatal|killed|out of memory", re.IGNORECASE)


def _host(row: sqlite3.Row) -> HostPublic:
    return HostPublic.model_validate(
        {
            **dict(row),
            "gpus": json.loads(row["gpus_json"] or "[]"),
            "sbatch_args": json.loads(row["sbatch_args_json"] or "[]"),
        }
    )


def _one(conn: sqlite3.Connection, table: str, key: str, value: Any, missing: str) -> sqlite3.Row:
    """The row of ``table`` whose ``key`` is ``value``; NotFound(``missing``) when there is none."""
    row = conn.execute(f"SELECT * FROM {table} WHERE {key}=?", (value,)).fetchone()
    if row is None:
        raise NotFound(missing)
    return row


def list_hosts(conn: sqlite3.Connection) -> list[HostPublic]:
    """Every host by name."""
    return [_host(r) for r in conn.execute("SELECT * FROM hosts ORDER BY name")]


def get_host(conn: sqlite3.Connection, name: str) -> HostPublic:
    """One host; NotFound names it."""
    return _host(_one(conn, "hosts", "name", name, f"no host named {name!r}"))


def host_row(conn: sqlite3.Connection, name: str) -> dict[str, Any]:
    """The raw host row (internal fields included)."""
    return dict(_one(conn, "hosts", "name", name, f"no host named {name!r}"))


def _in(ids: list[str]) -> str:
    return "(" + ",".join("?" * len(ids)) + ")"


def own_ids(conn: sqlite3.Connection, row: sqlite3.Row | dict[str, Any]) -> list[str]:
    """The run ids whose milestones, files and alerts are this run's: itself and, when sharded, its jobs."""
    return [row["id"], *shard_store.job_ids(conn, row["id"])] if row["shards"] else [row["id"]]


def check_tally(conn: sqlite3.Connection, ids: list[str]) -> verdict.CheckTally:
    """Files checked and failed (relative to the output directory), problems and alerts of these runs (a run,
    or a sharded run and its jobs)."""
    files = conn.execute(
        "SELECT json_extract(data_json, '$.file') AS f, min(coalesce(json_extract(data_json, '$.ok'), 0))"
        f" FROM events WHERE run_id IN {_in(ids)} AND kind='check' GROUP BY f ORDER BY min(id)",
        ids,
    ).fetchall()
    files = [(f, ok) for f, ok in files if isinstance(f, str) and f not in ("", ".")]
    return verdict.CheckTally(
        checked=[f for f, _ in files],
        bad=[f for f, ok in files if not ok],
        problems=conn.execute(f"SELECT count(*) FROM problems WHERE run_id IN {_in(ids)}", ids).fetchone()[0],
        alerts=conn.execute(f"SELECT count(*) FROM alerts WHERE run_id IN {_in(ids)}", ids).fetchone()[0],
    )


def _run(conn: sqlite3.Connection, row: sqlite3.Row) -> RunPublic:
    ids = own_ids(conn, row)
    open_alerts = conn.execute(
        f"SELECT count(*) FROM alerts WHERE run_id IN {_in(ids)} AND acked=0 AND muted=0", ids
    ).fetchone()[0]
    state = row["state"]
    # the verdict judges each shard's latest attempt (a resumed run does not count the run it resumes)
    judged = [row["id"], *shard_store.current_job_ids(conn, row["id"])] if row["shards"] else ids
    tally = check_tally(conn, judged) if state in verdict.TERMINAL else verdict.CheckTally()
    return RunPublic.model_validate(
        {
            **dict(row),
            "exit": json.loads(row["exit_json"]) if row["exit_json"] else None,
            "progress": json.loads(row["progress_json"]) if row["progress_json"] else None,
            "open_alerts": open_alerts,
            "verdict": verdict.verdict(state, tally),
            "verdict_text": verdict.verdict_text(state, tally),
        }
    )


def run_row(conn: sqlite3.Connection, run_id: str) -> dict[str, Any]:
    """The raw run row; NotFound names the id."""
    return dict(_one(conn, "runs", "id", run_id, f"no run {run_id!r}"))


def get_run_public(conn: sqlite3.Connection, run_id: str) -> RunPublic:
    """One run as listed."""
    return _run(conn, _one(conn, "runs", "id", run_id, f"no run {run_id!r}"))


def list_runs(conn: sqlite3.Connection, limit: int | None = None, offset: int = 0) -> list[RunPublic]:
    """Runs, newest first, ``limit`` of them from ``offset`` (all when None); a sharded run once: its
    shards' jobs are shown in it."""
    rows = conn.execute(
        "SELECT * FROM runs WHERE shard_of IS NULL ORDER BY created_at DESC, id DESC LIMIT ? OFFSET ?",
        (-1 if limit is None else max(0, int(limit)), max(0, int(offset))),
    )
    return [_run(conn, r) for r in rows]


def count_runs(conn: sqlite3.Connection) -> int:
    """How many runs ``list_runs`` pages through."""
    return int(conn.execute("SELECT count(*) FROM runs WHERE shard_of IS NULL").fetchone()[0])


def ended_before(conn: sqlite3.Connection, before: float) -> list[str]:
    """Ids of the runs (shards' jobs included) that ended before ``before``: those whose log gc may drop."""
    rows = conn.execute(
        f"SELECT id FROM runs WHERE state IN {TERMINAL_SQL} AND ended_at IS NOT NULL AND ended_at < ?",
        (before,),
    )
    return [r[0] for r in rows]


def nonterminal_runs(conn: sqlite3.Connection, host: str) -> list[dict[str, Any]]:
    """Runs of ``host`` that may still change (to follow after (re)connecting)."""
    rows = conn.execute(
        f"SELECT * FROM runs WHERE host=? AND state NOT IN {TERMINAL_SQL} AND shards IS NULL"
        " ORDER BY created_at",
        (host,),
    )
    return [dict(r) for r in rows]


def resumed_by(conn: sqlite3.Connection, run_id: str) -> list[str]:
    """The runs that resume ``run_id`` (one at most: a run is resumed once, crud.insert_run)."""
    return [
        r[0] for r in conn.execute("SELECT id FROM runs WHERE resumed_from=? ORDER BY created_at", (run_id,))
    ]


def output_dir_holders(conn: sqlite3.Connection, hosts: list[str]) -> list[dict[str, Any]]:
    """The jobs on ``hosts`` that have not ended, with the output_dir of their spec (id, host, state,
    shard_of, output_dir): each holds its directory until it ends."""
    rows = conn.execute(
        "SELECT id, host, state, shard_of, json_extract(spec_json, '$.output_dir') AS output_dir FROM runs"
        f" WHERE host IN {_in(hosts)} AND state NOT IN {TERMINAL_SQL} AND shards IS NULL",
        hosts,
    ).fetchall()
    return [dict(r) for r in rows]


def recently_ended_runs(conn: sqlite3.Connection, host: str, since: float) -> list[dict[str, Any]]:
    """Finished runs of ``host`` that ended after ``since``."""
    rows = conn.execute(
        f"SELECT * FROM runs WHERE host=? AND state IN {TERMINAL_SQL} AND ended_at > ? AND shards IS NULL"
        " ORDER BY ended_at",
        (host, since),
    )
    return [dict(r) for r in rows]


def _alert(row: sqlite3.Row) -> AlertPublic:
    return AlertPublic.model_validate(dict(row))


def get_alert(conn: sqlite3.Connection, alert_id: int) -> AlertPublic:
    """One alert; NotFound names the id."""
    return _alert(_one(conn, "alerts", "id", alert_id, f"no alert {alert_id}"))


def list_alerts(conn: sqlite3.Connection) -> list[AlertPublic]:
    """All alerts, newest first."""
    return [_alert(r) for r in conn.execute("SELECT * FROM alerts ORDER BY id DESC")]


def get_run_detail(conn: sqlite3.Connection, run_id: str) -> RunDetail:
    """A run with spec, milestones, alerts and problems."""
    row = _one(conn, "runs", "id", run_id, f"no run {run_id!r}")
    base = _run(conn, row)
    ids = own_ids(conn, row)
    order = "at, run_id, " if len(ids) > 1 else ""  # several jobs' journals: merged by time
    shard_of = {
        r[0]: r[1] for r in conn.execute(f"SELECT id, shard_index FROM runs WHERE id IN {_in(ids)}", ids)
    }
    milestones = []
    for m in conn.execute(f"SELECT * FROM milestones WHERE run_id IN {_in(ids)} ORDER BY {order}seq", ids):
        fields = json.loads(m["fields_json"] or "{}")
        shard = shard_of.get(m["run_id"])
        if shard is None and row["shards"] and type(fields.get("shard")) is int:
            shard = fields["shard"]  # an array job runs several shards: its milestones say whose they are
        milestones.append(MilestonePublic.model_validate({**dict(m), "shard": shard, "fields": fields}))
    alerts = [
        _alert(a) for a in conn.execute(f"SELECT * FROM alerts WHERE run_id IN {_in(ids)} ORDER BY id", ids)
    ]
    problems = [
        ProblemPublic.model_validate(dict(p))
        for p in conn.execute(
            f"SELECT * FROM problems WHERE run_id IN {_in(ids)} ORDER BY {order}seq, idx", ids
        )
    ]
    return RunDetail(
        **base.model_dump(),
        spec=json.loads(row["spec_json"]),
        resumed_from=row["resumed_from"],
        resumed_by=resumed_by(conn, run_id),
        milestones=milestones,
        alerts=alerts,
        problems=problems,
        shards=shard_store.shards(conn, run_id) if row["shards"] else None,
    )


def read_log(
    conn: sqlite3.Connection,
    run_id: str,
    after_offset: int,
    limit: int,
    query: str | None,
    errors_only: bool,
    before_offset: int | None = None,
) -> list[dict[str, Any]]:
    """Log lines after a byte offset, ascending (or the last ``limit`` before ``before_offset``), filtered.

    Lines are stored in blocks (controller/logblocks.py): the blocks that can hold such lines are read in
    offset order (backwards when paging back) and split; a search skips blocks whose text lacks the query."""
    get_run_public(conn, run_id)
    limit = max(1, min(int(limit), 100000))
    backwards = before_offset is not None
    sql = "SELECT offset, end_offset, text, offsets FROM log_blocks WHERE run_id=?"
    if backwards:
        sql += " AND offset < ? AND end_offset > ?"
        args: list[Any] = [run_id, before_offset, after_offset + 1]
    else:
        # The block holding the first line after ``after_offset`` starts at or before it.
        start = conn.execute(
            "SELECT max(offset) FROM log_blocks WHERE run_id=? AND offset <= ?", (run_id, after_offset)
        ).fetchone()[0]
        sql += " AND offset >= ?"
        args = [run_id, after_offset + 1 if start is None else start]
    if query:
        sql += " AND instr(lower(text), lower(?)) > 0"
        args.append(query)
    needle = query.lower() if query else None
    out: list[dict[str, Any]] = []
    # Both directions walk the (run_id, offset) index; paging back reads descending, then flips the page.
    for r in conn.execute(sql + (" ORDER BY offset DESC" if backwards else " ORDER BY offset"), args):
        lines = Block.from_row(r[0], r[1], r[2], r[3]).lines()
        if backwards:
            lines.reverse()
        for offset, text in lines:
            if offset <= after_offset or (before_offset is not None and offset >= before_offset):
                continue
            if needle is not None and needle not in text.lower():
                continue
            if errors_only and not _ERROR_RE.search(text):
                continue
            out.append({"offset": offset, "text": text})
            if len(out) >= limit:
                break
        if len(out) >= limit:
            break
    if backwards:
        out.reverse()
    return out


@contextlib.contextmanager
def _snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """One read transaction: every SELECT inside sees the same commit (WAL snapshot)."""
    if conn.in_transaction:  # already inside one (a write, or an outer snapshot)
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


def feed_since(
    conn: sqlite3.Connection, run_id: str | None, cursor: str | None, limit: int
) -> list[BusEvent]:
    """Everything committed after ``cursor``, merged in commit order (see bus.make_cursor)."""
    try:
        after_event, after_log = parse_cursor(cursor)
    except ValueError as exc:
        raise SpecInvalid([{"field": "cursor", "message": str(exc)}]) from None
    limit = max(1, min(int(limit), 10000))
    where_run = " AND run_id = ?" if run_id is not None else ""
    run_args: list[Any] = [run_id] if run_id is not None else []
    # Both SELECTs from one snapshot: log lines committed after the events were read would otherwise be
    # sent with a cursor before an event that precedes them, and then again live.
    with _snapshot(conn):
        events = conn.execute(
            f"SELECT * FROM events WHERE id > ?{where_run} AND kind IN ({','.join('?' * len(FEED_KINDS))})"
            " ORDER BY id LIMIT ?",
            [after_event, *run_args, *sorted(FEED_KINDS), limit],
        ).fetchall()
        logs: list[sqlite3.Row] = []
        size = 0
        logs_complete = True
        for row in conn.execute(
            "SELECT id, run_id, offset, end_offset, text, offsets FROM log_blocks"
            f" WHERE id > ?{where_run} ORDER BY id LIMIT ?",
            [after_log, *run_args, limit],
        ):
            logs.append(row)
            size += len(row[4])
            if size >= FEED_LOG_CHARS:  # a page of big blocks: the rest comes with the next page
                logs_complete = False
                break
        logs_complete = logs_complete and len(logs) < limit
    max_log = logs[-1][0] if logs else after_log
    out: list[BusEvent] = []
    li, last_event = 0, after_event

    def flush_logs(upto: int) -> None:
        nonlocal li
        while li < len(logs) and logs[li][0] <= upto:
            block_id, run, offset, end, text, blob = logs[li]
            data = Block.from_row(offset, end, text, blob).to_data()
            out.append(BusEvent("log", run, data, make_cursor(last_event, block_id)))
            li += 1

    for ev in events:
        if ev["log_mark"] > max_log and not logs_complete:
            return out  # lines this event follows were not fetched yet: resume from here next time
        flush_logs(ev["log_mark"])
        last_event = ev["id"]
        out.append(
            BusEvent(
                ev["kind"], ev["run_id"], json.loads(ev["data_json"]), make_cursor(ev["id"], ev["log_mark"])
            )
        )
    if len(events) < limit:
        flush_logs(max_log)
    return out


def due_outbox(conn: sqlite3.Connection, now: float) -> list[dict[str, Any]]:
    """Outbox rows due for delivery (not done, alert not muted), with their alert's rule and text."""
    rows = conn.execute(
        "SELECT o.id, o.alert_id, o.attempts, a.rule, a.severity, a.message FROM outbox o"
        " JOIN alerts a ON a.id = o.alert_id WHERE o.done=0 AND a.muted=0 AND o.next_attempt_at <= ?"
        " ORDER BY o.id LIMIT 100",
        (now,),
    )
    return [dict(r) for r in rows]
