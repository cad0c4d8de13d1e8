"""Pure Slurm bookkeeping: squeue rows parsed, Slurm job states mapped to run states, array tasks combined.

``squeue --states=all`` lists every job the controller still holds (ended ones for MinJobAge seconds), one
row per array task once tasks run (a pending array is one row, its task id a range).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

#: The squeue -O fields read, in order (``|`` after each; reasons and partitions never hold one).
SQUEUE_FIELDS = (
    "ArrayJobID",
    "ArrayTaskID",
    "JobID",
    "State",
    "Reason",
    "exit_code",
    "PriorityLong",
    "Partition",
)
SQUEUE_FORMAT = ",".join(f"{f}:|" for f in SQUEUE_FIELDS)


class SlurmParseError(ValueError):
    """A scheduler answer this module cannot read; the message quotes it."""


@dataclass(frozen=True)
class SlurmState:
    """What one Slurm job state means for a run."""

    phase: str  # pending | running | ended
    outcome: str | None  # for ended: completed | failed | cancelled
    meaning: str


_P, _R, _E = "pending", "running", "ended"
#: Every Slurm job state (squeue/scontrol/sacct names, 22.05) → what it means for the run.
STATES: dict[str, SlurmState] = {
    "PENDING": SlurmState(_P, None, "waiting in the queue"),
    "CONFIGURING": SlurmState(_P, None, "nodes allocated, being configured"),
    "REQUEUED": SlurmState(_P, None, "requeued, waiting to run again"),
    "REQUEUE_HOLD": SlurmState(_P, None, "requeued and held"),
    "REQUEUE_FED": SlurmState(_P, None, "requeued by the federation"),
    "RESV_DEL_HOLD": SlurmState(_P, None, "held after its reservation was deleted"),
    "RUNNING": SlurmState(_R, None, "running"),
    "COMPLETING": SlurmState(_R, None, "ending: processes are being cleaned up"),
    "SUSPENDED": SlurmState(_R, None, "suspended by the scheduler (keeps its allocation)"),
    "STOPPED": SlurmState(_R, None, "stopped by SIGSTOP (keeps its allocation)"),
    "SIGNALING": SlurmState(_R, None, "being signalled"),
    "STAGE_OUT": SlurmState(_R, None, "staging out its burst buffer"),
    "RESIZING": SlurmState(_R, None, "being resized"),
    "COMPLETED": SlurmState(_E, "completed", "ended with exit code 0 on every node"),
    "FAILED": SlurmState(_E, "failed", "ended with a non-zero exit code or could not start"),
    "CANCELLED": SlurmState(_E, "cancelled", "cancelled (scancel)"),
    "TIMEOUT": SlurmState(_E, "failed", "killed by the scheduler: it ran past its time limit"),
    "OUT_OF_MEMORY": SlurmState(_E, "failed", "killed by the scheduler: it ran out of its memory limit"),
    "NODE_FAIL": SlurmState(_E, "failed", "ended because one of its nodes failed"),
    "PREEMPTED": SlurmState(_E, "failed", "ended by preemption (a higher-priority job took its nodes)"),
    "BOOT_FAIL": SlurmState(_E, "failed", "its node failed to boot"),
    "DEADLINE": SlurmState(_E, "failed", "ended at its deadline"),
    "SPECIAL_EXIT": SlurmState(_E, "failed", "held after a special exit value"),
    "REVOKED": SlurmState(_E, "failed", "revoked by a sibling cluster of the federation"),
}
#: Ended outcomes from best to worst: an array's outcome is its worst task's.
_RANK = {"completed": 0, "cancelled": 1, "failed": 2}


def state_of(name: str) -> SlurmState:
    """The meaning of a Slurm state (sacct's ``CANCELLED by 0`` too); an unknown one counts as running."""
    base = name.split()[0].rstrip("+") if name.strip() else ""
    return STATES.get(base, SlurmState(_R, None, f"in Slurm state {name!r}, unknown to eaglewatch"))


@dataclass(frozen=True)
class TaskRow:
    """One row of squeue: a job, or one task (or still-pending range of tasks) of an array job."""

    job_id: str  # the id the user submitted: the array's id for its tasks
    task: str | None  # array task id, a pending range like "0-1" or "[2-3%1]", None for a plain job
    state: str
    reason: str
    exit_status: int | None  # a wait(2) status: code << 8 | signal
    priority: int
    partition: str


def parse_squeue(text: str) -> list[TaskRow]:
    """Rows of ``squeue --noheader --states=all -O SQUEUE_FORMAT``; SlurmParseError quoting a bad line."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < len(SQUEUE_FIELDS):
            raise SlurmParseError(
                f"squeue line has {len(parts)} fields, expected {len(SQUEUE_FIELDS)}: {line[:200]!r}"
            )
        array_id, task, job_id, state, reason, status, prio, partition = parts[: len(SQUEUE_FIELDS)]
        plain = task in ("", "N/A")
        rows.append(
            TaskRow(
                job_id=job_id if plain else array_id,
                task=None if plain else task,
                state=state,
                reason=reason,
                exit_status=int(status) if status.isdigit() else None,
                priority=int(prio) if prio.isdigit() else 0,
                partition=partition,
            )
        )
    return rows


def exit_fields(status: int | None) -> dict[str, object]:
    """``code``/``signal``/``signal_name`` of a wait status (as exit.json holds them)."""
    if status is None:
        return {"code": None, "signal": None, "signal_name": None}
    sig, code = status & 0x7F, (status >> 8) & 0xFF
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return {"code": None, "signal": sig, "signal_name": name}
    return {"code": code, "signal": None, "signal_name": None}


@dataclass(frozen=True)
class JobView:
    """One submitted job (all its array tasks) as the run sees it."""

    job_id: str
    phase: str  # pending | running | ended
    state: str  # the Slurm state that decides (the worst task's when ended)
    reason: str | None
    position: int | None  # 1-based place among pending jobs of its partition, while pending
    outcome: str | None = None
    exit_status: int | None = None
    tasks: dict[str, str] = field(default_factory=dict)  # task id (or "" for a plain job) → Slurm state

    def describe(self) -> str:
        """One line for the timeline and the final reason."""
        text = f"Slurm job {self.job_id} {self.state}: {state_of(self.state).meaning}"
        if self.phase == "pending" and self.reason and self.reason != "None":
            text += f" (reason {self.reason}"
            text += f", position {self.position})" if self.position else ")"
        return text


def _position(rows: list[TaskRow], mine: TaskRow) -> int:
    """1 + pending jobs of the same partition ahead of ``mine`` (squeue's order: priority, then job id)."""

    def key(r: TaskRow) -> tuple[int, int]:
        return (-r.priority, int(r.job_id) if r.job_id.isdigit() else 0)

    ahead = {
        r.job_id
        for r in rows
        if r.partition == mine.partition
        and state_of(r.state).phase == _P
        and r.job_id != mine.job_id
        and key(r) < key(mine)
    }
    return len(ahead) + 1


def task_ids(field: str) -> list[int]:
    """The array task ids a squeue task field names: ``3``, ``0-1``, ``[0,2-5:2%1]``; [] for none."""
    out: list[int] = []
    for part in field.strip().strip("[]").split("%")[0].split(","):
        first, _, rest = part.partition("-")
        last, _, step = rest.partition(":")
        if first.isdigit() and (not last or last.isdigit()) and (not step or step.isdigit()):
            out.extend(range(int(first), int(last or first) + 1, int(step or 1) or 1))
    return out


def task_states(tasks: dict[str, str]) -> dict[int, str]:
    """Each array task id → its Slurm state, from a view's ``tasks`` (a pending range names all its ids)."""
    return {i: str(state) for key, state in tasks.items() for i in task_ids(str(key))}


def combine(job_id: str, rows: list[TaskRow], array: int | list[int] | None) -> JobView | None:
    """The view of job ``job_id`` from all squeue rows; None when squeue no longer lists it.

    ``array``: the array's size (tasks 0 to N-1) or the task ids still to be seen to end (tasks that left
    the queue unseen are taken out: jobs.ended_tasks), None for a plain job."""
    mine = [r for r in rows if r.job_id == job_id]
    if not mine:
        return None
    tasks = {r.task or "": r.state for r in mine}
    phases = [state_of(r.state).phase for r in mine]
    if _R in phases:
        running = next(r for r in mine if state_of(r.state).phase == _R)
        return JobView(job_id, _R, running.state, running.reason, None, tasks=tasks)
    if _P in phases:
        pending = next(r for r in mine if state_of(r.state).phase == _P)
        return JobView(job_id, _P, pending.state, pending.reason, _position(rows, pending), tasks=tasks)
    expected = range(array) if isinstance(array, int) else array or []
    covered = task_states(tasks)
    if any(i not in covered for i in expected):
        # Every listed task has ended but one squeue does not list has not been seen to: not over yet.
        last = mine[-1]
        return JobView(job_id, _R, last.state, last.reason, None, tasks=tasks)
    worst = max(mine, key=lambda r: (_RANK[state_of(r.state).outcome or "failed"], r.exit_status or 0))
    return JobView(
        job_id,
        _E,
        worst.state,
        worst.reason,
        None,
        outcome=state_of(worst.state).outcome,
        exit_status=worst.exit_status,
        tasks=tasks,
    )


def parse_sacct(text: str, job_id: str) -> JobView | None:
    """The ended view of ``job_id`` from ``sacct -n -P -X -o JobID,State,ExitCode``; None when not listed."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not (parts[0] == job_id or parts[0].startswith(f"{job_id}_")):
            continue
        code, _, sig = parts[2].partition(":")
        status = (int(code) << 8 if code.isdigit() else 0) | (int(sig) if sig.isdigit() else 0)
        task = parts[0].partition("_")[2] or None
        rows.append(TaskRow(job_id, task, parts[1].split()[0] if parts[1] else "", "", status, 0, ""))
    if not rows:
        return None
    return combine(job_id, rows, None)
