"""Jobs on the host: spawn detached (under agent.jobs.supervise), tell alive/ended/lost, stop for real."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent import settings
from agent.jobs import procfs
from agent.paths import RunPaths, atomic_write_json, read_json

_PKG_ROOT = Path(__file__).resolve().parents[2]


class SpawnError(Exception):
    """The job could not be started; the message says why."""


def spawn(paths: RunPaths, argv: list[str], env: dict[str, str], cwd: str | None = None) -> dict[str, Any]:
    """Start ``argv`` detached under a supervisor; return the job record (pid, start_time, boot_id, argv)."""
    atomic_write_json(
        paths.launch, {"argv": argv, "env": {**env, settings.RUN_ID.name: paths.run}, "cwd": cwd}
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "agent.jobs.supervise", str(paths.dir)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            start_new_session=True,
            cwd=_PKG_ROOT,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpawnError(f"cannot run the supervisor: {exc}") from None
    try:
        record = json.loads(proc.stdout)
    except ValueError:
        tail = proc.stderr.decode("utf-8", "replace")[-500:]
        raise SpawnError(f"supervisor exited {proc.returncode} without a job record: {tail}") from None
    if not isinstance(record, dict) or "error" in record:
        raise SpawnError(str(record.get("error") if isinstance(record, dict) else record))
    return record


def job_alive(job: dict[str, Any] | None) -> bool:
    """True when the recorded job (pid + start time + boot id) is still running."""
    if not job or not isinstance(job.get("pid"), int):
        return False
    return procfs.is_same_process(job["pid"], job.get("start_time"), job.get("boot_id"))


def classify(paths: RunPaths) -> str:
    """``alive`` (pid, start time and boot id match), ``finished`` (exit.json on disk), or ``lost``."""
    if isinstance(read_json(paths.exit), dict):
        return "finished"
    job = read_json(paths.job)
    job = job if isinstance(job, dict) else None
    if job is not None and job.get("scheduler") == "slurm":
        # The poller writes exit.json when Slurm says the job ended; gone from squeue and sacct is lost.
        sched = read_json(paths.sched)
        return "lost" if isinstance(sched, dict) and sched.get("vanished") else "alive"
    return "alive" if job_alive(job) else "lost"


def run_processes(
    run: str, job: dict[str, Any] | None, exclude: set[int], born_after: int | None = None
) -> list[int]:
    """Live processes of the run: the job's process group and every process of ours carrying its run id.

    ``born_after`` (clock ticks since boot, the job's own start time): older processes are passed over
    without reading their environment, as none of them can descend from the job."""
    entry = f"{settings.RUN_ID.name}={run}".encode()
    uid = os.getuid()
    group = job["pid"] if job_alive(job) and job else None
    found = []
    for pid in procfs.pids():
        if pid in exclude:
            continue
        st = procfs.stat(pid)
        if st is None or st.state in ("Z", "X") or (born_after is not None and st.start_time < born_after):
            continue
        if (group is not None and st.pgid == group) or (
            procfs.owner(pid) == uid and procfs.environ_has(pid, entry)
        ):
            found.append(pid)
    return found


def request_stop(paths: RunPaths, by: str, reason: str) -> None:
    """Record that the run is being stopped (first request wins), so the final state says why."""
    if not paths.stop.exists():
        atomic_write_json(paths.stop, {"requested_at": time.time(), "by": by, "reason": reason})


def stop(
    paths: RunPaths, grace_s: float = 10.0, by: str = "client", reason: str = "stopped by request"
) -> dict[str, Any]:
    """SIGTERM the run's processes, SIGKILL what is left after ``grace_s``, confirm none remains."""
    job = read_json(paths.job)
    job = job if isinstance(job, dict) else None
    if job is not None and job.get("attached"):
        from agent.jobs import attached  # a job the agent did not start: a detach unless allowed

        if not job.get("allow_stop"):
            reason = f"{reason}: detached, the job was not signalled (attached without allow_stop)"
        request_stop(paths, by, reason)
        return attached.stop(paths, job, grace_s)
    request_stop(paths, by, reason)
    if job is not None and job.get("scheduler") == "slurm":
        from agent.sched import jobs as sched_jobs  # only a Slurm host's stop needs it

        return sched_jobs.stop(paths, grace_s)
    exclude = {os.getpid()}
    if job and isinstance(job.get("supervisor_pid"), int):
        exclude.add(job["supervisor_pid"])
    killed: dict[int, dict[str, Any]] = {}

    def sweep(sig: signal.Signals, seconds: float) -> list[int]:
        """Signal the run's processes, and those that appear within ``seconds``; the ones still there."""
        left = run_processes(paths.run, job, exclude)
        for pid in left:  # recorded before signalling: the group signal may end them before we look
            killed.setdefault(pid, {"pid": pid, "cmdline": procfs.cmdline(pid)})["signal"] = sig.name
        if job and job_alive(job):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job["pid"], sig)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + seconds
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = run_processes(paths.run, job, exclude)
            for pid in left:  # children started after the signal get theirs too
                if pid not in killed:
                    killed[pid] = {"pid": pid, "cmdline": procfs.cmdline(pid), "signal": sig.name}
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
        return left

    remaining = sweep(signal.SIGTERM, max(0.0, grace_s))
    if remaining:
        remaining = sweep(signal.SIGKILL, 5.0)
    return {
        "run": paths.run,
        "killed": sorted(killed.values(), key=lambda k: k["pid"]),
        "remaining": remaining,
        "confirmed": not remaining,
        "gpu_released": gpu_released(set(killed)),
    }


def gpu_released(pids: set[int]) -> bool | None:
    """False while nvidia-smi lists one of ``pids`` holding GPU memory; None on a host without GPUs."""
    from agent.jobs import gpus  # imported late: only a stop that confirms GPU release needs it

    try:
        info = gpus.query()
    except Exception:
        return None
    if not info.get("gpus"):
        return None
    holding = {p.get("pid") for p in info.get("processes", [])}
    return not (holding & pids)
