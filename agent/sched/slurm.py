"""Slurm through its own commands (sbatch, squeue, scancel, sacct), argv lists only, never a shell string.

The batch script holds fixed text only: it runs ``python -m agent.sched.task RUN_DIR``, which reads the
job's argv and environment from the run's launch.json (the same record a local job's supervisor reads)
and execs it; no user input ever passes through a shell.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from agent.paths import RunPaths
from agent.sched.options import SlurmOptions
from agent.sched.slurmstate import SQUEUE_FORMAT, JobView, TaskRow, parse_sacct, parse_squeue

_PKG_ROOT = Path(__file__).resolve().parents[2]
COMMAND_TIMEOUT_S = 30.0
#: What Slurm's commands say when the controller cannot be reached (not a refusal of the request).
_UNREACHABLE = (
    "Unable to contact slurm controller",
    "Could not establish a configuration",
    "Connection refused",
    "Zero Bytes were transmitted",
)


class SlurmError(Exception):
    """Slurm refused or could not be reached; the message says which command and why."""


def sbatch_argv(
    paths: RunPaths, opts: SlurmOptions, gpus: int | None, time_limit_min: int | None
) -> list[str]:
    """The sbatch command line for a run (the script path last)."""
    out = str(paths.dir / "output.task-%a.log") if opts.shards else str(paths.log)
    argv = [
        "sbatch",
        "--parsable",
        f"--job-name=ew-{paths.run}",
        f"--chdir={paths.dir}",
        f"--output={out}",
        "--open-mode=append",
    ]
    if opts.shards:
        ids = opts.task_ids() or []
        spread = ids == list(range(opts.shards))
        argv.append(f"--array=0-{opts.shards - 1}" if spread else f"--array={','.join(map(str, ids))}")
    if opts.partition:
        argv.append(f"--partition={opts.partition}")
    if opts.account:
        argv.append(f"--account={opts.account}")
    if time_limit_min:
        argv.append(f"--time={time_limit_min}")
    if gpus and opts.gpus == "gpus-per-task":
        argv.append(f"--gpus-per-task={gpus}")
    elif gpus and opts.gpus == "gres":
        argv.append(f"--gres=gpu:{gpus}")
    return [*argv, *opts.sbatch_args, str(paths.dir / "job.sbatch")]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError:
        raise SlurmError(
            f"Slurm is not reachable: {argv[0]} is not on PATH ({os.environ.get('PATH', '')})"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"Slurm is not reachable: {argv[0]} gave no answer in {COMMAND_TIMEOUT_S:.0f} s"
        ) from None


def _why(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
    text = (
        "; ".join(ln.removeprefix("sbatch: error: ") for ln in lines[-3:]) or f"exit status {proc.returncode}"
    )
    if any(s in text for s in _UNREACHABLE):
        return f"Slurm is not reachable: {text}"
    return text


def submit(
    paths: RunPaths, opts: SlurmOptions, gpus: int | None, time_limit_min: int | None
) -> tuple[str, list[str]]:
    """Write the batch script and submit it; (job id, sbatch argv). SlurmError with sbatch's own words."""
    script = paths.dir / "job.sbatch"
    script.write_text(  # fixed program text: the job itself comes from launch.json
        "#!/bin/sh\n"
        "# eaglewatch: runs the job recorded in launch.json beside this script\n"
        f"export PYTHONPATH={shlex.quote(str(_PKG_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"exec {shlex.quote(sys.executable)} -m agent.sched.task {shlex.quote(str(paths.dir))}\n"
    )
    script.chmod(0o700)
    argv = sbatch_argv(paths, opts, gpus, time_limit_min)
    proc = _run(argv)
    if proc.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {_why(proc)}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {proc.stdout.strip()[:200]!r}")
    return job_id, argv


def query() -> list[TaskRow]:
    """Every job the Slurm controller holds (one squeue call); SlurmError when it cannot be asked."""
    proc = _run(["squeue", "--noheader", "--states=all", "-O", SQUEUE_FORMAT])
    if proc.returncode != 0:
        raise SlurmError(f"squeue failed: {_why(proc)}")
    return parse_squeue(proc.stdout)


def accounted(job_id: str) -> JobView | None:
    """sacct's record of an ended job; None where the cluster keeps no accounting or has no record."""
    proc = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode"])
    if proc.returncode != 0:
        return None  # "Slurm accounting storage is disabled" on clusters without slurmdbd
    return parse_sacct(proc.stdout, job_id)


def cancel(job_id: str) -> None:
    """scancel the job (every task of an array); SlurmError with scancel's words."""
    proc = _run(["scancel", job_id])
    if proc.returncode != 0:
        raise SlurmError(f"scancel {job_id} failed: {_why(proc)}")
