"""The per-job supervisor: ``python -m agent.jobs.supervise RUN_DIR`` starts the job and records its end.

The daemon runs this in a new session; it forks once so the real supervisor is not the daemon's child (the
job and its supervisor survive the daemon, the SSH link and the controller), starts the job in its own
session and process group, writes ``job.json`` (pid, start time, boot id), relays that record to the daemon
on stdout and then waits for the job, writing ``exit.json`` (code or signal) atomically when it ends.
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
from agent.paths import RunPaths, atomic_write_json, read_json


def _ignore(_signum: int, _frame: object) -> None:
    """A no-op handler: unlike SIG_IGN it is reset to default in the job at exec."""


def exit_record(returncode: int) -> dict[str, Any]:
    """The exit.json content for a Popen return code (negative = killed by that signal)."""
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return {"code": None, "signal": sig, "signal_name": name, "ended_at": time.time()}
    return {"code": returncode, "signal": None, "signal_name": None, "ended_at": time.time()}


def _start_job(paths: RunPaths) -> tuple[subprocess.Popen[bytes] | None, dict[str, Any]]:
    """Start the job described by launch.json; return it and the record to relay (or an error record)."""
    launch = read_json(paths.launch)
    if not isinstance(launch, dict) or not isinstance(launch.get("argv"), list):
        return None, {"error": f"{paths.launch} is missing or malformed"}
    argv = [str(a) for a in launch["argv"]]
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (launch.get("env") or {}).items()})
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
    atomic_write_json(paths.job, record)
    return proc, record


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
    try:
        proc, record = _start_job(paths)
    except Exception as exc:  # anything at all: the daemon must get an answer
        proc, record = None, {"error": f"supervisor failed: {exc!r}"}
    if proc is None:
        atomic_write_json(
            paths.exit,
            {
                "code": 127,
                "signal": None,
                "signal_name": None,
                "ended_at": time.time(),
                "error": record["error"],
            },
        )
    os.write(wfd, (json.dumps(record) + "\n").encode())
    os.close(wfd)
    if proc is not None:
        atomic_write_json(paths.exit, exit_record(proc.wait()))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
