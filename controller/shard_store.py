"""A sharded run in the database: its shard rows, their jobs (runs of their own) and its one aggregate row.

A sharded run is one `runs` row users see (``shards`` = N) plus one `run_shards` row per shard naming the
job (an ordinary, hidden `runs` row with ``shard_of``) of the shard's latest attempt.  Jobs ingest their
journals like any run, so each milestone is stored once, under its job; whenever a job's row changes
(crud.publish_run) the sharded run's state, progress and last milestone are derived again here.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from controller import sharding
from controller.lifecycle import is_terminal
from controller.models import ShardPublic

#: A shard row's own columns for a task of an array job (copied with the row when a new run carries it).
TASK_COLUMNS = ("task", "task_state", "task_reason", "task_progress_json", "task_milestone")


def insert_shard(
    tx_conn: sqlite3.Connection,
    run_id: str,
    idx: int,
    host: str,
    gpus: Any,
    job_id: str,
    attempts: int = 1,
    task: int | None = None,
) -> None:
    """The shard row of a new sharded run (its first attempt; ``task``: its task id in the array job)."""
    tx_conn.execute(
        "INSERT INTO run_shards(run_id, idx, host, gpus_json, job_id, attempts, task) VALUES (?,?,?,?,?,?,?)",
        (run_id, idx, host, json.dumps(gpus), job_id, attempts, task),
    )


def carry_shard(tx_conn: sqlite3.Connection, from_run: str, run_id: str, idx: int) -> None:
    """A shard of the run a new one resumes, carried over as it is (its job, attempts and task record)."""
    cols = ", ".join(("idx", "host", "gpus_json", "job_id", "attempts", *TASK_COLUMNS))
    tx_conn.execute(
        f"INSERT INTO run_shards(run_id, {cols}) SELECT ?, {cols} FROM run_shards WHERE run_id=? AND idx=?",
        (run_id, from_run, idx),
    )


def replace_job(tx_conn: sqlite3.Connection, run_id: str, idx: int, job_id: str) -> None:
    """A shard's new attempt: its row names the new job (a job of its own, no longer an array's task)."""
    tx_conn.execute(
        "UPDATE run_shards SET job_id=?, attempts=attempts+1, task=NULL, task_state=NULL, task_reason=NULL,"
        " task_progress_json=NULL, task_milestone=NULL WHERE run_id=? AND idx=?",
        (job_id, run_id, idx),
    )


def note_tasks(
    tx_conn: sqlite3.Connection, job_id: str, milestones: list[tuple[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """What an array job's milestones (kind, fields with ``shard``) say of each task's own shard row:
    its progress, its last milestone and, from ``task_ended``, its state and reason.

    Returns the tasks that have just failed, as run-like rows (id: the array job, name naming the shard
    and the run, host) for their ``run_failed`` alert: the array job itself goes on."""
    failed = []
    for kind, fields in milestones:
        task = fields.get("shard")
        if type(task) is not int:
            continue
        row = tx_conn.execute(
            "SELECT s.task_state, s.host, r.name, r.shards FROM run_shards s JOIN runs r ON r.id = s.run_id"
            " WHERE s.job_id=? AND s.task=?",
            (job_id, task),
        ).fetchone()
        if row is None:  # no shard's latest attempt is this task any more (it was resumed as its own job)
            continue
        cols: dict[str, Any] = {"task_milestone": kind}
        if kind == "progress":
            cols["task_progress_json"] = json.dumps(fields)
        elif kind == "task_ended" and fields.get("outcome") in ("completed", "failed", "stopped"):
            cols["task_state"] = fields["outcome"]
            cols["task_reason"] = str(fields.get("reason") or "")[:500] or None
            if fields["outcome"] == "failed" and row["task_state"] != "failed":
                name = f"{row['name']} shard {task}/{row['shards']}"
                failed.append(
                    {"id": job_id, "name": name, "host": row["host"], "reason": cols["task_reason"]}
                )
        sets = ", ".join(f"{k}=:{k}" for k in cols)  # names from the code above, never from data
        tx_conn.execute(
            f"UPDATE run_shards SET {sets} WHERE job_id=:job AND task=:task",
            {**cols, "job": job_id, "task": task},
        )
    return failed


def has_tasks(tx_conn: sqlite3.Connection, job_id: str) -> bool:
    """Whether some shard row is a task of this (array) job."""
    sql = "SELECT 1 FROM run_shards WHERE job_id=? AND task IS NOT NULL LIMIT 1"
    return tx_conn.execute(sql, (job_id,)).fetchone() is not None


def parents_of(conn: sqlite3.Connection, job_id: str) -> list[str]:
    """The sharded runs whose shard's latest attempt is this job."""
    return [r[0] for r in conn.execute("SELECT run_id FROM run_shards WHERE job_id=?", (job_id,))]


def _current(conn: sqlite3.Connection, run_id: str) -> list[sqlite3.Row]:
    return conn.execute(
        "SELECT s.idx, s.host, s.gpus_json, s.job_id, s.attempts, r.state, r.progress_json, r.last_milestone,"
        " r.failure_reason, r.started_at, s.task, s.task_state, s.task_reason, s.task_progress_json,"
        " s.task_milestone FROM run_shards s JOIN runs r ON r.id = s.job_id"
        " WHERE s.run_id=? ORDER BY s.idx",
        (run_id,),
    ).fetchall()


def _own(r: sqlite3.Row) -> dict[str, Any]:
    """A shard's state, progress, last milestone and failure reason: its job's, or for a task of an array
    job (sharding.task_state) what the job's journal said of that task."""
    if r["task"] is None:
        return {
            "state": r["state"],
            "progress_json": r["progress_json"],
            "last_milestone": r["last_milestone"],
            "failure_reason": r["failure_reason"],
        }
    state = sharding.task_state(r["state"], r["task_state"])
    reason = None
    if state != "completed" and is_terminal(state):
        reason = r["task_reason"] if r["task_state"] else r["failure_reason"]
    return {
        "state": state,
        "progress_json": r["task_progress_json"],
        "last_milestone": r["task_milestone"] or r["last_milestone"],
        "failure_reason": reason,
    }


def shards(conn: sqlite3.Connection, run_id: str) -> list[ShardPublic]:
    """A sharded run's shard table (empty for an ordinary run)."""
    out = []
    for r in _current(conn, run_id):
        own = _own(r)
        progress = json.loads(own["progress_json"]) if own["progress_json"] else None
        shard = {
            **dict(r),
            **own,
            "index": r["idx"],
            "gpus": json.loads(r["gpus_json"]),
            "progress": progress,
        }
        out.append(ShardPublic.model_validate(shard))
    return out


def job_ids(conn: sqlite3.Connection, run_id: str) -> list[str]:
    """Every job of a sharded run, each attempt included (their milestones, alerts and files are its)."""
    rows = conn.execute(
        "SELECT id FROM runs WHERE shard_of=? UNION SELECT job_id FROM run_shards WHERE run_id=?",
        (run_id, run_id),
    ).fetchall()
    return sorted(r[0] for r in rows)


def current_job_ids(conn: sqlite3.Connection, run_id: str) -> list[str]:
    """The job of each shard's latest attempt, each once (what the run's verdict judges)."""
    rows = conn.execute("SELECT job_id FROM run_shards WHERE run_id=? ORDER BY idx", (run_id,))
    return list(dict.fromkeys(r[0] for r in rows))


def aggregate(conn: sqlite3.Connection, run_id: str, now: float, changed_job: str | None) -> bool:
    """Derive the sharded run's state, progress and last milestone from its shards' latest attempts.

    A terminal state never moves back: resuming a shard of an ended sharded run starts a new one.
    Returns whether the row changed.
    """
    run = conn.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
    found = _current(conn, run_id)
    if run is None or not found:
        return False
    rows = [{**dict(r), **_own(r)} for r in found]
    progress = sharding.run_progress(
        [json.loads(r["progress_json"]) if r["progress_json"] else None for r in rows]
    )
    last = run["last_milestone"]
    for r in rows:
        if r["job_id"] == changed_job and r["last_milestone"]:
            last = r["last_milestone"]
    cols: dict[str, Any] = {
        "progress_json": json.dumps(progress) if progress else None,
        "last_milestone": last,
    }
    if not is_terminal(run["state"]):
        state = sharding.run_state([r["state"] for r in rows])
        cols["state"] = state
        started = [r["started_at"] for r in rows if r["started_at"] is not None]
        cols["started_at"] = run["started_at"] or (min(started) if started else None)
        if is_terminal(state):
            cols["ended_at"] = now
            failed = [f"shard {r['idx']} {r['state']}: {r['failure_reason'] or 'no reason given'}"
                      for r in rows if r["state"] != "completed"]  # fmt: skip
            cols["failure_reason"] = "; ".join(failed) or None
    if all(run[k] == v for k, v in cols.items()):
        return False
    sets = ", ".join(f"{k}=:{k}" for k in cols)  # names from the code above, never from data
    conn.execute(f"UPDATE runs SET {sets} WHERE id=:id", {**cols, "id": run_id})
    return True
