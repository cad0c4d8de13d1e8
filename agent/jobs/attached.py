"""Jobs the agent did not start: their record, whether they still run, and stop (a detach unless allowed).

docs/architecture.md ("Attached runs") says what differs from a launched run; a pid is followed as a tree
of (pid, start time) pairs, kept in job.json, so descendants re-parented to init still count.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from agent.jobs import procfs
from agent.paths import RunPaths, atomic_write_json, read_json
from agent.runs.jobspec import AttachSpec

#: Why an attached job's watching ended without an exit status (exit.json ``attached``).
GONE = "gone"
IDLE = "idle"
DETACHED = "detached"


def record(attach: AttachSpec) -> dict[str, Any]:
    """job.json for an attached job, read now (a pid's start time and the boot id identify it)."""
    rec: dict[str, Any] = {"attached": True, "allow_stop": attach.allow_stop, "attached_at": time.time()}
    if attach.pid is not None:
        start = procfs.start_time(attach.pid)
        rec.update(pid=attach.pid, start_time=start, boot_id=procfs.boot_id(), tree=[[attach.pid, start]])
    elif attach.slurm_job is not None:
        rec.update(scheduler="slurm", job_id=attach.slurm_job)
    return rec


def pid_refusal(pid: int, allow_stop: bool) -> str | None:
    """Why ``pid`` cannot be attached to (None when it can): it must run, and be ours to stop it."""
    st = procfs.stat(pid)
    if st is None or st.state in ("Z", "X"):
        return f"no process {pid} runs on this host"
    if allow_stop and procfs.owner(pid) != os.getuid():
        return f"process {pid} belongs to another user: eaglewatch could not stop it (leave allow_stop out)"
    return None


def slurm_refusal(job_id: str) -> str | None:
    """Why Slurm job ``job_id`` cannot be attached to (None when Slurm holds or accounted for it)."""
    from agent.sched import slurm  # only a Slurm attach asks

    try:
        if any(row.job_id == job_id for row in slurm.query()) or slurm.accounted(job_id) is not None:
            return None
    except (slurm.SlurmError, OSError) as exc:
        return f"cannot ask Slurm about job {job_id}: {exc}"
    return f"Slurm knows no job {job_id}"


def log_floor(paths: RunPaths) -> int:
    """The first log offset a run shows: past what a log attached "from now" already held (0 otherwise)."""
    rec = read_json(paths.job)
    start = rec.get("log_from") if isinstance(rec, dict) else None
    return start if isinstance(start, int) and not isinstance(start, bool) and start > 0 else 0


def log_start(path: str) -> int:
    """Where a log followed "from now" starts: just past its last complete line (a partial one is read
    whole once it ends)."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        back = min(size, 1 << 16)
        while back:
            fh.seek(size - back)
            tail = fh.read(back)
            cut = tail.rfind(b"\n")
            if cut >= 0:
                return size - back + cut + 1
            if back == size:
                break
            back = min(size, back * 2)
    return 0


def live_tree(tree: list[list[int]]) -> list[list[int]]:
    """The members of ``tree`` ([pid, start time] pairs) still running, with every descendant of theirs."""
    children: dict[int, list[procfs.Stat]] = {}
    for pid in procfs.pids():
        st = procfs.stat(pid)
        if st is not None and st.state not in ("Z", "X"):
            children.setdefault(st.ppid, []).append(st)
    boot = procfs.boot_id()
    alive = [[p, s] for p, s in tree if procfs.is_same_process(p, s, boot)]
    seen = {p for p, _ in alive}
    todo = [p for p, _ in alive]
    while todo:
        for st in children.get(todo.pop(), []):
            if st.pid not in seen:
                seen.add(st.pid)
                alive.append([st.pid, st.start_time])
                todo.append(st.pid)
    return alive


def look(paths: RunPaths) -> bool:
    """One look at an attached pid's tree: the record follows it; True once none of it runs (exit.json
    written). A job attached without a pid is never over here."""
    job = read_json(paths.job)
    if not isinstance(job, dict) or not isinstance(job.get("tree"), list):
        return False
    tree = live_tree(job["tree"])
    if not tree:
        end(paths, GONE)
        return True
    if tree != job["tree"]:
        atomic_write_json(paths.job, {**job, "tree": tree}, fsync=False)
    return False


def end(paths: RunPaths, how: str) -> None:
    """Write exit.json for a job whose exit status the agent cannot know (``how``: gone, idle, detached)."""
    if not paths.exit.exists():
        atomic_write_json(
            paths.exit, {"code": None, "signal": None, "attached": how, "ended_at": time.time()}
        )


def stop(paths: RunPaths, job: dict[str, Any], grace_s: float, poll_s: float = 0.05) -> dict[str, Any]:
    """Detach (the job is not signalled) unless the record allows a stop; then SIGTERM the tree, SIGKILL
    what is left after ``grace_s``, confirm (a Slurm job: scancel). The caller recorded stop.json."""
    result: dict[str, Any] = {
        "run": paths.run,
        "killed": [],
        "remaining": [],
        "confirmed": True,
        "gpu_released": None,
        "detached": not job.get("allow_stop"),
    }
    if job.get("allow_stop") and job.get("scheduler") == "slurm":
        from agent.sched import jobs as sched_jobs  # only a Slurm host's stop needs it

        return {**sched_jobs.stop(paths, grace_s), "detached": False}
    if job.get("allow_stop") and isinstance(job.get("tree"), list):
        tree = job["tree"]
        killed: dict[int, dict[str, Any]] = {}
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            tree = live_tree(tree)
            for pid, _start in tree:
                killed[pid] = {"pid": pid, "cmdline": procfs.cmdline(pid), "signal": sig.name}
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + max(0.0, wait)
            while tree and time.monotonic() < deadline:
                time.sleep(poll_s)
                tree = live_tree(tree)
            if not tree:
                break
        remaining = [p for p, _ in tree]
        result.update(
            killed=sorted(killed.values(), key=lambda k: k["pid"]),
            remaining=remaining,
            confirmed=not remaining,
        )
        if remaining:
            return result
    end(paths, DETACHED if result["detached"] else GONE)
    return result
