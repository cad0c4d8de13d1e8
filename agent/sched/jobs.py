"""A run as a Slurm job: submit it, follow the poller's looks into its run dir, scancel it and confirm.

``sched.json`` in the run dir holds the last look; ``advance`` turns a new one into the new record, the
journal events (docs/slurm.md) and, once the job has ended, the exit record the watcher turns into the
final state.  The daemon's one ``SlurmPoller`` makes one squeue call per interval for all runs at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from agent import settings
from agent.paths import RunPaths, atomic_write_json, read_json
from agent.runs.summary import milestone_event
from agent.sched import slurm
from agent.sched.options import SlurmOptions
from agent.sched.slurmstate import JobView, combine, exit_fields, state_of, task_states

log = logging.getLogger("eaglewatch.agent")


def expected_tasks(paths: RunPaths) -> int | list[int] | None:
    """What ``combine`` waits for: an array's recorded task ids (its size before they were recorded) less
    those that left the queue unseen (sched.json ``gone``); None for a plain job."""
    job = read_json(paths.job)
    job = job if isinstance(job, dict) else {}
    tasks = job.get("tasks")
    if not (isinstance(tasks, list) and all(isinstance(t, int) for t in tasks)):
        return job.get("array") if isinstance(job.get("array"), int) else None
    sched = read_json(paths.sched)
    gone = sched.get("gone") if isinstance(sched, dict) else None
    return [t for t in tasks if t not in (gone or [])]


#: The shards a job writes: (count, shard indices); None for a job of the whole dataset.
Claim = tuple[int, set[int]] | None


def shard_claim(shard: tuple[int, int] | None, opts: SlurmOptions | None) -> Claim:
    """The shards a new job writes: its spec's one shard, or an array's task ids."""
    if shard is not None:
        return shard[1], {shard[0]}
    if opts is not None and opts.shards:
        return opts.shards, set(opts.task_ids() or [])
    return None


def live_claim(shard: tuple[int, int] | None, paths: RunPaths) -> Claim:
    """The shards an active job still writes: its one shard, or its array's tasks not yet ended."""
    if shard is not None:
        return shard[1], {shard[0]}
    job = read_json(paths.job)
    job = job if isinstance(job, dict) else {}
    expected = expected_tasks(paths)
    if not isinstance(job.get("array"), int) or expected is None:
        return None
    ids = set(range(expected)) if isinstance(expected, int) else set(expected)
    sched = read_json(paths.sched)
    seen = sched.get("tasks") if isinstance(sched, dict) else None
    ended = {
        t
        for t, st in task_states(seen if isinstance(seen, dict) else {}).items()
        if state_of(st).phase == "ended"
    }
    return job["array"], ids - ended


def disjoint_shards(mine_dir: str, mine: Claim, other_dir: str | None, other: Claim) -> bool:
    """True when two jobs write different shards of one sharded run's output_dir (files never collide)."""
    return (
        mine is not None
        and other is not None
        and mine[0] == other[0]
        and not mine[1] & other[1]
        and other_dir is not None
        and os.path.normpath(mine_dir) == os.path.normpath(other_dir)
    )


def submit(
    paths: RunPaths,
    argv: list[str],
    env: dict[str, str],
    opts: SlurmOptions,
    gpus: int | None,
    time_limit_min: int | None,
) -> dict[str, Any]:
    """Record the job (launch.json), sbatch it, write job.json and sched.json; the job record.

    On a refusal exit.json says why (the run ends failed, "could not start: sbatch refused …") and the
    SlurmError goes on to the caller."""
    atomic_write_json(paths.launch, {"argv": argv, "env": env, "cwd": str(paths.dir), "shards": opts.shards})
    try:
        job_id, sbatch = slurm.submit(paths, opts, gpus, time_limit_min)
    except slurm.SlurmError as exc:
        atomic_write_json(
            paths.exit,
            {"code": 127, "signal": None, "signal_name": None, "ended_at": time.time(), "error": str(exc)},
        )
        raise
    record = {
        "scheduler": "slurm",
        "job_id": job_id,
        "array": opts.shards,
        "tasks": opts.task_ids(),
        "argv": argv,
        "sbatch": sbatch,
        "submitted_at": time.time(),
    }
    atomic_write_json(paths.job, record)
    # Every task starts out pending: one that leaves the queue before a look sees it is still noticed.
    pending = {str(t): "PENDING" for t in opts.task_ids() or []}
    atomic_write_json(
        paths.sched, {"job_id": job_id, "array": opts.shards, "phase": "submitted", "tasks": pending}
    )
    return record


def apply_look(
    paths: RunPaths, view: JobView | None, error: str | None, line: int
) -> tuple[list[dict[str, Any]], bool]:
    """Take one look of the poller into the run dir; (events to journal, True once the job has ended)."""
    prev = read_json(paths.sched)
    prev = prev if isinstance(prev, dict) else {}
    rec, events, exit_rec = advance(prev, view, error, line, time.time(), paths.stop.exists())
    atomic_write_json(paths.sched, rec, fsync=False)
    if exit_rec is not None and not paths.exit.exists():
        atomic_write_json(paths.exit, exit_rec)
    return events, exit_rec is not None or bool(rec.get("vanished"))


def stop(paths: RunPaths, grace_s: float, poll_s: float = 2.0) -> dict[str, Any]:
    """scancel the whole job, then wait until Slurm says it ended (sacct where kept, else squeue)."""
    job = read_json(paths.job)
    job = job if isinstance(job, dict) else {}
    job_id, array = str(job.get("job_id")), expected_tasks(paths)
    result: dict[str, Any] = {
        "run": paths.run,
        "killed": [],
        "remaining": [],
        "confirmed": False,
        "gpu_released": None,
        "job_id": job_id,
        "scheduler_state": None,
    }
    try:
        slurm.cancel(job_id)
        deadline = time.monotonic() + max(grace_s, 5.0) + 30.0  # KillWait, then epilog: tens of seconds
        view = None
        while time.monotonic() < deadline:
            view = combine(job_id, slurm.query(), array)
            if view is None or view.phase == "ended":
                break
            time.sleep(poll_s)
    except slurm.SlurmError as exc:
        result["error"] = str(exc)
        return result
    acct = slurm.accounted(job_id)
    final, by = (acct, "sacct") if acct is not None and acct.phase == "ended" else (view, "squeue")
    if final is not None and final.phase == "ended":
        result.update(confirmed=True, confirmed_by=by, scheduler_state=final.state)
        if not paths.exit.exists():
            atomic_write_json(paths.exit, exit_record(final, time.time()))
    else:
        result["remaining"] = [job_id]
    return result


# ---- what a look means for the run (pure) ---------------------------------------------------------
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
    """A ``task_ended`` milestone for each array task ended since the last look, and the ids of tasks that
    left the queue unseen (``gone``): a pending one was cancelled (it leaves no record), a running one
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
    rec.update(
        phase=view.phase, state=view.state, reason=view.reason, position=view.position, tasks=view.tasks
    )
    if view.phase == "pending":
        if ran_before:  # requeued (preempted, node failure): waits again
            events.append({"type": "state", "state": "pending", "reason": view.describe()})
        if prev.get("phase") != "pending" or prev.get("reason") != view.reason:
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
    elif not ran_before and view.outcome != "cancelled":
        # It left the queue (perhaps ending between two looks): the run was running, whatever comes next.
        events.append({"type": "state", "state": "running"})
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


# ---- the daemon's poller ---------------------------------------------------------------------------
Look = Callable[[str, JobView | None, str | None], None]


class SlurmPoller:
    """Tracks run → (job id, array size or task ids); calls ``on_look(run, view, error)`` after each look.

    interval_s: seconds between scheduler calls (default settings.SLURM_POLL_S: gentle on slurmctld)."""

    def __init__(self, on_look: Look, interval_s: float | None = None) -> None:
        self.on_look = on_look
        self.interval_s = settings.SLURM_POLL_S.get() if interval_s is None else interval_s
        self.jobs: dict[str, tuple[str, int | list[int] | None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def track(self, run: str, job_id: str, array: int | list[int] | None) -> None:
        """Watch ``job_id`` for ``run`` (a new submission or one re-adopted after a restart)."""
        self.jobs[run] = (job_id, array)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="slurm-poller")
        self._wake.set()

    def untrack(self, run: str) -> None:
        """Stop asking about ``run`` (it has ended)."""
        self.jobs.pop(run, None)

    def close(self) -> None:
        """Stop polling (the jobs keep running; a restarted daemon re-adopts them)."""
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            if not self.jobs:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.poll_once()
            except Exception:  # a bug here must not end polling for every run
                log.exception("slurm poll failed")
            await asyncio.sleep(self.interval_s)  # a fixed pace: at most one squeue per interval

    async def poll_once(self) -> None:
        """One squeue call for all tracked runs; sacct only for a job squeue no longer lists."""
        # Only runs tracked before squeue is asked: a job submitted while the call is under way is missing
        # from its answer, and would read as gone.
        asked = dict(self.jobs)
        try:
            rows = await asyncio.to_thread(slurm.query)
        except slurm.SlurmError as exc:
            for run in asked:
                self.on_look(run, None, str(exc))
            return
        for run, (job_id, array) in asked.items():
            if self.jobs.get(run) != (job_id, array):
                continue  # untracked (ended, or re-tracked) while squeue ran
            view = combine(job_id, rows, array)
            if view is None:  # past MinJobAge: only accounting, where the cluster keeps it, still knows
                view = await asyncio.to_thread(slurm.accounted, job_id)
            self.on_look(run, view, None)
