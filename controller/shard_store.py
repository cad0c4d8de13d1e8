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


def insert_shard(
    tx_conn: sqlite3.Connection, run_id: str, idx: int, host: str, gpus: Any, job_id: str, attempts: int = 1
) -> None:
    """The shard row of a new sharded run (its first attempt, or one carried over from the run it resumes)."""
    tx_conn.execute(
        "INSERT INTO run_shards(run_id, idx, host, gpus_json, job_id, attempts) VALUES (?,?,?,?,?,?)",
        (run_id, idx, host, json.dumps(gpus), job_id, attempts),
    )


def replace_job(tx_conn: sqlite3.Connection, run_id: str, idx: int, job_id: str) -> None:
    """A shard's new attempt: its row names the new job."""
    tx_conn.execute(
        "UPDATE run_shards SET job_id=?, attempts=attempts+1 WHERE run_id=? AND idx=?", (job_id, run_id, idx)
    )


def parents_of(conn: sqlite3.Connection, job_id: str) -> list[str]:
    """The sharded runs whose shard's latest attempt is this job."""
    return [r[0] for r in conn.execute("SELECT run_id FROM run_shards WHERE job_id=?", (job_id,))]


def _current(conn: sqlite3.Connection, run_id: str) -> list[sqlite3.Row]:
    return conn.execute(
        "SELECT s.idx, s.host, s.gpus_json, s.job_id, s.attempts, r.state, r.progress_json, r.last_milestone,"
        " r.failure_reason, r.started_at FROM run_shards s JOIN runs r ON r.id = s.job_id"
        " WHERE s.run_id=? ORDER BY s.idx",
        (run_id,),
    ).fetchall()


def shards(conn: sqlite3.Connection, run_id: str) -> list[ShardPublic]:
    """A sharded run's shard table (empty for an ordinary run)."""
    return [
        ShardPublic(
            index=r["idx"],
            host=r["host"],
            gpus=json.loads(r["gpus_json"]),
            job_id=r["job_id"],
            attempts=r["attempts"],
            state=r["state"],
            progress=json.loads(r["progress_json"]) if r["progress_json"] else None,
            last_milestone=r["last_milestone"],
            failure_reason=r["failure_reason"],
        )
        for r in _current(conn, run_id)
    ]


def job_ids(conn: sqlite3.Connection, run_id: str) -> list[str]:
    """Every job of a sharded run, each attempt included (their milestones, alerts and files are its)."""
    rows = conn.execute(
        "SELECT id FROM runs WHERE shard_of=? UNION SELECT job_id FROM run_shards WHERE run_id=?",
        (run_id, run_id),
    ).fetchall()
    return sorted(r[0] for r in rows)


def current_job_ids(conn: sqlite3.Connection, run_id: str) -> list[str]:
    """The job of each shard's latest attempt (what the run's verdict judges)."""
    return [
        r[0] for r in conn.execute("SELECT job_id FROM run_shards WHERE run_id=? ORDER BY idx", (run_id,))
    ]


def aggregate(conn: sqlite3.Connection, run_id: str, now: float, changed_job: str | None) -> bool:
    """Derive the sharded run's state, progress and last milestone from its shards' latest attempts.

    A terminal state never moves back: resuming a shard of an ended sharded run starts a new one.
    Returns whether the row changed.
    """
    run = conn.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
    rows = _current(conn, run_id)
    if run is None or not rows:
        return False
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
