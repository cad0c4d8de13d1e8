"""Small readers of /proc: process start time, state, group, environment, command line, output file; the
boot id."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


def boot_id() -> str:
    """This boot's random id (changes at every reboot); empty when unknown."""
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/<pid>/stat the agent uses."""

    pid: int
    state: str
    ppid: int
    pgid: int
    start_time: int  # clock ticks since boot (field 22): with the pid, identifies one process


def stat(pid: int) -> Stat | None:
    """Parse /proc/<pid>/stat; None when the process is gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it start past the last ')'.
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return Stat(
            pid=pid, state=rest[0].decode(), ppid=int(rest[1]), pgid=int(rest[2]), start_time=int(rest[19])
        )
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when it is gone."""
    st = stat(pid)
    return st.start_time if st else None


def is_same_process(pid: int, start: int | None, boot: str | None) -> bool:
    """True when ``pid`` is still the process recorded as (pid, start, boot) and has not exited (any
    process of that pid, start and boot None)."""
    if boot and boot != boot_id():
        return False
    st = stat(pid)
    return st is not None and st.state not in ("Z", "X") and (start is None or st.start_time == start)


def pids() -> Iterator[int]:
    """Every pid currently in /proc."""
    try:
        names = os.listdir(_PROC)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def owner(pid: int) -> int | None:
    """The uid owning ``pid``."""
    try:
        return os.stat(_PROC / str(pid)).st_uid
    except OSError:
        return None


def environ_has(pid: int, entry: bytes) -> bool:
    """True when ``pid``'s initial environment holds exactly ``entry`` (b"KEY=value")."""
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return entry in raw.split(b"\0")


def cmdline(pid: int) -> str:
    """The command line of ``pid`` joined by spaces (capped), or '' when unreadable."""
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")[:500]


def output_file(pid: int) -> str | None:
    """The regular file ``pid``'s stdout (else its stderr) is written to: a job started by hand as
    ``cmd > log 2>&1 &``.  None for a terminal, a pipe or a socket, or a process this user may not read."""
    for fd in (1, 2):
        try:
            target = os.readlink(_PROC / str(pid) / "fd" / str(fd))
            if target.startswith("/") and os.path.isfile(target):  # "pipe:[…]", "/dev/pts/3" fail here
                return target
        except OSError:
            continue
    return None
