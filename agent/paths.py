"""Where the agent keeps its state: the state dir, the daemon socket and one directory per run."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Run ids name a directory: letters, digits, '.', '_', '-', starting with a letter or digit (\Z, not $:
#: "x\n" is no run id).
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


class StateWriteError(OSError):
    """A state file could not be written; the message names the full device or the file."""

    def __str__(self) -> str:
        return str(self.strerror)


def valid_run_id(run: object) -> bool:
    """True when ``run`` is a string usable as a run id (and so as a directory name)."""
    return isinstance(run, str) and RUN_ID_RE.match(run) is not None and run not in (".", "..")


class _RunFile:
    """A file of the run directory, read as ``paths.<name>``: ``paths.dir / filename``."""

    def __init__(self, filename: str) -> None:
        self.filename = filename

    def __get__(self, paths: RunPaths, owner: object = None) -> Path:
        return paths.dir / self.filename


@dataclass(frozen=True)
class RunPaths:
    """The files of one run under ``<state>/runs/<id>/``."""

    run: str
    dir: Path

    #: The run spec as received (written before anything starts).
    spec = _RunFile("spec.json")
    #: argv, env additions and cwd handed to the supervisor.
    launch = _RunFile("launch.json")
    #: The job's stdout+stderr.
    log = _RunFile("output.log")
    #: The journal.
    events = _RunFile("events.jsonl")
    #: pid, start time and boot id of the job, written by the supervisor.
    job = _RunFile("job.json")
    #: The job's exit code or signal, written by the supervisor when it ends.
    exit = _RunFile("exit.json")
    #: Present once a stop was requested (by a client or by the agent's own shape-check policy).
    stop = _RunFile("stop.json")
    #: The watcher's durable position: log offset, line number, engine snapshot, checked files.
    cursor = _RunFile("cursor.json")
    #: The scheduler's last word on a submitted job (Slurm: state, reason, queue position, tasks).
    sched = _RunFile("sched.json")
    #: The supervisor's own stderr (start failures).
    supervisor_log = _RunFile("supervisor.log")


def runs_dir(state_dir: Path) -> Path:
    """The directory holding one sub-directory per run."""
    return state_dir / "runs"


def run_paths(state_dir: Path, run: str) -> RunPaths:
    """The paths of run ``run``; raises ValueError for an id that is not a safe name."""
    if not valid_run_id(run):
        raise ValueError(
            f"run id {run!r} must be 1-64 of letters, digits, '.', '_', '-', starting with a letter or digit"
        )
    return RunPaths(run=run, dir=runs_dir(state_dir) / run)


def write_problem(exc: OSError, path: Path) -> str:
    """Why writing ``path`` failed, in words: a full device or quota names its directory."""
    if exc.errno == errno.ENOSPC:
        return f"no space left on device in {path.parent}"
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded in {path.parent}"
    return f"cannot write {path}: {exc.strerror or exc}"


def atomic_write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename (readers never see half);
    StateWriteError says why it failed, and no temporary file is left behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:  # a nearly full device may take part of it; the next write says why not all
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise StateWriteError(exc.errno, write_problem(exc, path)) from exc


def read_json(path: Path) -> Any:
    """The JSON content of ``path``, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
