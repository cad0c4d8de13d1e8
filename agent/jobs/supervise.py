"""The per-job supervisor: ``python -m agent.jobs.supervise RUN_DIR`` starts the job and records its end.

The daemon runs this in a new session; it forks once so the real supervisor is not the daemon's child (the
job and its supervisor survive the daemon, the SSH link and the controller), starts the job in its own
session and process group, writes ``job.json`` (pid, start time, boot id), relays that record to the daemon
on stdout and then waits for the job, writing ``exit.json`` (code or signal) atomically when it ends.

The room for ``exit.json`` is taken before the job starts: a job that fills the agent's disk still has its
end recorded, with the reason (``state_error``: "no space left on device in DIR") the run's state names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent.jobs import procfs
from agent.paths import RunPaths, atomic_write_json, read_json, write_problem
from agent.sched.slurmstate import exit_fields

#: exit.json's reserved room: far more than a record takes (its state_error is cut to fit).
_RESERVE_BYTES = 4096
_RESERVE_NAME = ".exit.json.reserve"


def _ignore(_signum: int, _frame: object) -> None:
    """A no-op handler: unlike SIG_IGN it is reset to default in the job at exec."""


def exit_record(returncode: int) -> dict[str, Any]:
    """The exit.json content for a Popen return code (negative = killed by that signal)."""
    return {**exit_fields(-returncode if returncode < 0 else returncode << 8), "ended_at": time.time()}


def _start_job(paths: RunPaths) -> tuple[subprocess.Popen[bytes] | None, dict[str, Any]]:
    """Start the job described by launch.json; return it and the record to relay (or an error record)."""
    launch = read_json(paths.launch)
    if not isinstance(launch, dict) or not isinstance(launch.get("argv"), list):
        return None, {"error": f"{paths.launch} is missing or malformed"}
    argv = [str(a) for a in launch["argv"]]
    env = {**os.environ, **{str(k): str(v) for k, v in (launch.get("env") or {}).items()}}
    cwd = launch.get("cwd") or str(paths.dir)
    log_fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
            close_fds=True,
        )
    except OSError as exc:
        msg = f"cannot start {argv[0] if argv else '(empty argv)'}: {exc.strerror or exc}"
        os.write(log_fd, f"eaglewatch-agent: {msg}\n".encode())
        return None, {"error": msg}
    finally:
        os.close(log_fd)
    record = {
        "pid": proc.pid,
        "start_time": procfs.start_time(proc.pid),
        "boot_id": procfs.boot_id(),
        "argv": argv,
        "supervisor_pid": os.getpid(),
        "started_at": time.time(),
    }
    try:
        atomic_write_json(paths.job, record)
    except OSError as exc:  # a job nobody could find again must not run on
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, {"error": f"cannot record the job: {exc}"}
    return proc, record


def _reserve(paths: RunPaths) -> int:
    """Take exit.json's room now, while the device has some: an open file of spaces (JSON may end in them)."""
    path = paths.dir / _RESERVE_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        left = memoryview(b" " * _RESERVE_BYTES)
        while left:
            left = left[os.write(fd, left) :]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _record_exit(paths: RunPaths, rec: dict[str, Any], reserve: int | None) -> None:
    """Write exit.json; when that fails (a full device), into the reserved room, with the reason."""
    try:
        atomic_write_json(paths.exit, rec)
    except OSError as exc:
        if reserve is None:
            return  # nothing reserved: the daemon has the start failure from the relayed record
        data = json.dumps({**rec, "state_error": str(exc)[:1024]}).encode()
        os.pwrite(reserve, data.ljust(_RESERVE_BYTES), 0)  # overwrites room already taken: no new blocks
        os.fsync(reserve)
        os.replace(paths.dir / _RESERVE_NAME, paths.exit)
    else:
        if reserve is not None:
            os.unlink(paths.dir / _RESERVE_NAME)
    finally:
        if reserve is not None:
            os.close(reserve)


def main(argv: list[str]) -> int:
    """Entry point; prints the job record (or {"error": ...}) as one JSON line, then returns."""
    if len(argv) != 1:
        print("usage: python -m agent.jobs.supervise RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    paths = RunPaths(run=run_dir.name, dir=run_dir)
    rfd, wfd = os.pipe()
    if os.fork() > 0:
        os.close(wfd)
        chunks = []
        while chunk := os.read(rfd, 65536):
            chunks.append(chunk)
        sys.stdout.write(b"".join(chunks).decode("utf-8", "replace"))
        sys.stdout.flush()
        return 0
    # The real supervisor: detach its stdio from the daemon's pipe, keep stderr for start failures.
    os.close(rfd)
    devnull = os.open(os.devnull, os.O_RDWR)
    err = os.open(paths.supervisor_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(err, 2)
    os.close(devnull)
    os.close(err)
    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _ignore)
    reserve: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        reserve = _reserve(paths)
        proc, record = _start_job(paths)
    except OSError as exc:
        record = {"error": write_problem(exc, paths.exit) if reserve is None else f"supervisor failed: {exc}"}
    except Exception as exc:  # anything at all: the daemon must get an answer
        record = {"error": f"supervisor failed: {exc!r}"}
    if proc is None:
        _record_exit(paths, {**exit_record(127), "error": record["error"]}, reserve)
    os.write(wfd, (json.dumps(record) + "\n").encode())
    os.close(wfd)
    if proc is not None:
        _record_exit(paths, exit_record(proc.wait()), reserve)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
