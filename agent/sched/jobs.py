"""A run as a Slurm job: submit it, apply the poller's looks to its run dir, scancel it and confirm."""

from __future__ import annotations

import os
import time
from typing import Any

from agent.paths import RunPaths, atomic_write_json, read_json
from agent.sched import slurm
from agent.sched.options import SlurmOptions
from agent.sched.slurmstate import JobView, combine, state_of, task_states
from agent.sched.tracking import advance, exit_record


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
