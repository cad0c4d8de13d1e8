"""Pure: what a new look at the scheduler means for a run — its record, timeline events and exit record.

``sched.json`` in the run dir holds the last look (``job_id``, ``array``, ``phase``, ``state``, ``reason``,
``position``, ``tasks``, ``error``, ``vanished``). ``advance`` compares a new look with it and returns the
new record, the journal events to append (``queued`` while the job waits, with Slurm's reason and the queue
position; ``scheduled`` when its tasks start; a ``warning`` when Slurm cannot be asked, once per outage) and,
once the job has ended, the exit record the watcher turns into the final state (summary.final_state).
"""

from __future__ import annotations

from typing import Any

from agent.runs.summary import milestone_event
from agent.sched.slurmstate import JobView, exit_fields, state_of, task_states


def exit_record(view: JobView, now: float) -> dict[str, Any]:
    """exit.json for an ended job: the worst task's exit status and the Slurm state that decides."""
    return {
        **exit_fields(view.exit_status),
        "ended_at": now,
        "scheduler": "slurm",
        "job_id": view.job_id,
        "scheduler_state": view.state,
        "scheduler_reason": state_of(view.state).meaning,
        "tasks": view.tasks,
    }


def task_outcome(slurm_state: str, stopping: bool) -> str:
    """The run state one ended array task stands for: completed, failed, or stopped (cancelled by a stop;
    a task cancelled otherwise, e.g. ``scancel JOB_TASK`` by hand or by an admin, failed)."""
    outcome = state_of(slurm_state).outcome
    if outcome == "cancelled":
        return "stopped" if stopping else "failed"
    return outcome or "failed"


def _task_event(job_id: str, task: int, state: str, outcome: str, reason: str, line: int) -> dict[str, Any]:
    return milestone_event(
        "task_ended",
        line,
        f"Slurm job {job_id} task {task} {reason}",
        job_id=job_id,
        shard=task,
        slurm_state=state,
        outcome=outcome,
        reason=reason,
    )


def ended_tasks(
    prev: dict[str, Any], view: JobView, line: int, stopping: bool
) -> tuple[list[dict[str, Any]], list[int]]:
    """A ``task_ended`` milestone (fields ``shard``, ``slurm_state``, ``outcome``, ``reason``) for each array
    task that has ended since the last look (what lets the controller show each shard's own state), and
    the ids of tasks that left the queue unseen (``gone``).

    A pending task cancelled on its own (``scancel JOB_TASK``) leaves no record: it only drops out of the
    array's pending range, so it is taken as cancelled. A running task that vanished without its end seen
    (past MinJobAge while the daemon was down) is taken as failed, its outcome unknown."""
    given = prev.get("tasks")
    before = task_states(given if isinstance(given, dict) else {})
    now = task_states(view.tasks)
    gone_before = {int(t) for t in prev.get("gone") or [] if isinstance(t, int)}
    events = []
    for task, state in sorted(now.items()):
        if state_of(state).phase != "ended" or state_of(before.get(task, "")).phase == "ended":
            continue
        reason = f"{state}: {state_of(state).meaning}"
        events.append(_task_event(view.job_id, task, state, task_outcome(state, stopping), reason, line))
    gone = []
    for task, state in sorted(before.items()):
        if task in now or task in gone_before or state_of(state).phase == "ended":
            continue
        gone.append(task)
        if state_of(state).phase == "pending":
            reason = "CANCELLED: left the queue before it started (cancelled)"
            events.append(
                _task_event(view.job_id, task, "CANCELLED", task_outcome("CANCELLED", stopping), reason, line)
            )
        else:
            reason = f"left the queue in state {state} without its end being seen: outcome unknown"
            events.append(_task_event(view.job_id, task, state, "failed", reason, line))
    return events, gone


def advance(
    prev: dict[str, Any],
    view: JobView | None,
    error: str | None,
    line: int,
    now: float,
    stopping: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """(record, events, exit record or None) after a look that found ``view`` (None: not listed any more)
    or failed with ``error`` (Slurm not reachable: the job is left as it was, never called lost).
    ``stopping``: a stop was asked for (a cancelled task was stopped, not failed)."""
    rec = dict(prev)
    events: list[dict[str, Any]] = []
    job = str(prev.get("job_id"))
    if error is not None:
        if not prev.get("error"):
            events.append(
                milestone_event(
                    "warning",
                    line,
                    f"cannot ask Slurm about job {job}: {error}",
                    rule="slurm_unreachable",
                    job_id=job,
                )
            )
        rec["error"] = error
        return rec, events, None
    rec["error"] = None
    if view is None:
        rec["vanished"] = True
        return rec, events, None
    ran_before = prev.get("phase") in ("running", "ended")
    if view.phase == "pending" and ran_before:  # requeued (preempted, node failure): waits again
        events.append({"type": "state", "state": "pending", "reason": view.describe()})
    elif not ran_before and (
        view.phase == "running" or (view.phase == "ended" and view.outcome != "cancelled")
    ):
        # It left the queue (perhaps ending between two looks): the run was running, whatever comes next.
        events.append({"type": "state", "state": "running"})
    rec.update(
        phase=view.phase, state=view.state, reason=view.reason, position=view.position, tasks=view.tasks
    )
    if view.phase == "pending" and (prev.get("phase") != "pending" or prev.get("reason") != view.reason):
        events.append(
            milestone_event(
                "queued",
                line,
                view.describe(),
                job_id=job,
                slurm_state=view.state,
                reason=view.reason,
                position=view.position,
            )
        )
    elif view.phase in ("running", "ended") and not ran_before and view.outcome != "cancelled":
        events.append(
            milestone_event(
                "scheduled",
                line,
                f"Slurm job {job} is running",
                job_id=job,
                slurm_state=view.state,
                tasks=view.tasks,
            )
        )
    if prev.get("array") is not None:
        said, gone = ended_tasks(prev, view, line, stopping)
        events.extend(said)
        if gone:
            rec["gone"] = sorted({*(prev.get("gone") or []), *gone})
    if view.phase == "ended":
        return rec, events, exit_record(view, now)
    return rec, events, None
