"""Test helpers: a real agent daemon subprocess on a tmp state dir, and a small sync JSON-lines client.

from tests.helpers.agentproc import agent_daemon, AgentClient   # agent_daemon is a pytest fixture

def test_x(agent_daemon):
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="r1", spec={"backend": "command", "command": [...]})
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent import protocol

REPO = Path(__file__).resolve().parents[2]


class AgentError(Exception):
    """The daemon answered a request with an error reply."""

    def __init__(self, message: dict[str, Any]) -> None:
        super().__init__(f"{message.get('code')}: {message.get('message')}")
        self.code = message.get("code")
        self.reply = message


@dataclass
class AgentProc:
    """A daemon subprocess (its own process group) on ``state_dir``, listening on ``socket``."""

    state_dir: Path
    socket: Path
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        """The daemon's pid."""
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the daemon's process group and reap it (jobs live in their own sessions and survive)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def start_agent(
    state_dir: Path,
    socket_path: Path | None = None,
    timeout: float = 40.0,  # a ceiling, not a wait: parallel tests on 2 cores slow a start down
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> AgentProc:
    """Start ``python -m agent daemon [args]`` and wait until its socket answers."""
    socket_path = socket_path or state_dir / "agent.sock"
    state_dir.mkdir(parents=True, exist_ok=True)
    err = open(state_dir / "daemon.stderr", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent",
            "daemon",
            "--state-dir",
            str(state_dir),
            "--socket",
            str(socket_path),
            *args,
        ],
        stdin=subprocess.DEVNULL,
        stdout=err,
        stderr=err,
        start_new_session=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    err.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"daemon exited {proc.returncode}: {(state_dir / 'daemon.stderr').read_text()}"
            )
        if _hello_pid(socket_path) == proc.pid:  # ours, not a daemon still shutting down on the same path
            return AgentProc(state_dir, socket_path, proc)
        time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise RuntimeError("daemon did not listen in time")


def _hello_pid(socket_path: Path) -> int | None:
    """The pid in the hello of the daemon answering on ``socket_path`` (None when nobody answers)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(str(socket_path))
        data = b""
        while b"\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
        pid = json.loads(data.split(b"\n", 1)[0]).get("pid")
        return pid if isinstance(pid, int) else None
    except (OSError, ValueError):
        return None
    finally:
        sock.close()


def cleanup_runs(state_dir: Path) -> None:
    """Kill every job (and leftover worker) of every run under ``state_dir``, then their supervisors."""
    from agent.jobs import control as jobs
    from agent.jobs.procfs import is_same_process
    from agent.paths import read_json, run_paths

    runs = state_dir / "runs"
    if not runs.is_dir():
        return
    killed: list[int] = []
    for d in runs.iterdir():
        try:
            paths = run_paths(state_dir, d.name)
        except ValueError:
            continue
        job = read_json(paths.job)
        if isinstance(job, dict) and job.get("scheduler") == "slurm":
            subprocess.run(["scancel", str(job.get("job_id"))], capture_output=True, timeout=30, check=False)
        elif isinstance(job, dict) and not job.get("attached"):  # an attached job is its test's to end
            # run_processes also catches setsid'd children carrying the run id.
            for pid in jobs.run_processes(d.name, job, {os.getpid()}):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job["pid"], signal.SIGKILL)
                killed.append(job["pid"])
    deadline = time.monotonic() + 10
    while any(is_same_process(p, None, None) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def agent_daemon(tmp_path: Path) -> Iterator[AgentProc]:
    """A running daemon on ``tmp_path/state``; teardown kills it and every job it started."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        yield agent
    finally:
        agent.kill()
        cleanup_runs(state)


class AgentClient:
    """A blocking JSON-lines client: ``request`` returns the reply; streamed messages queue in ``stream``."""

    def __init__(self, socket_path: Path, timeout: float = 20.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(socket_path))
        except OSError:
            self.sock.close()
            raise
        self.timeout = timeout
        self._lines: deque[bytes] = deque()  # complete lines not read yet
        self._partial: list[bytes] = []  # the start of a line whose end has not arrived
        self._next_id = 0
        self.stream: deque[dict[str, Any]] = deque()
        self.hello = self._read()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (fuzzing)."""
        self.sock.sendall(data)

    def _line(self) -> bytes:
        # complete lines split off once per read and a partial line kept in pieces: linear in what arrives
        # (re-splitting the whole buffer per message made a long backlog quadratic)
        while not self._lines:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            if b"\n" not in chunk:
                self._partial.append(chunk)
                continue
            *done, rest = b"".join([*self._partial, chunk]).split(b"\n")
            self._lines.extend(done)
            self._partial = [rest] if rest else []
        return self._lines.popleft()

    def _read(self, timeout: float | None = None) -> dict[str, Any]:
        self.sock.settimeout(timeout if timeout is not None else self.timeout)
        msg = protocol.decode_message(self._line())
        size = protocol.payload_size(msg)
        if size is not None:  # a log block's text: whole lines, ``size`` bytes with their newlines
            parts: list[bytes] = []
            while size > 0:
                parts.append(self._line())
                size -= len(parts[-1]) + 1
            msg = protocol.attach_payload(msg, b"\n".join(parts) + b"\n")
        return msg

    def read_message(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message that is not a reply (stream or unsolicited), from the queue or the socket."""
        if self.stream:
            return self.stream.popleft()
        return self._read(timeout)

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        """Send a request; return its reply or error message (stream messages meanwhile are queued)."""
        self._next_id += 1
        rid = self._next_id
        self.sock.sendall(json.dumps({"id": rid, "op": op, **args}).encode() + b"\n")
        return self.reply_to(rid)

    def reply_to(self, rid: Any) -> dict[str, Any]:
        """Read until the reply/error carrying ``rid``."""
        while True:
            msg = self._read()
            if msg.get("type") in ("reply", "error") and msg.get("id") == rid:
                return msg
            self.stream.append(msg)

    def result(self, op: str, **args: Any) -> dict[str, Any]:
        """The result of a request, or AgentError."""
        msg = self.request(op, **args)
        if msg.get("type") != "reply":
            raise AgentError(msg)
        result: dict[str, Any] = msg["result"]
        return result

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> list[dict[str, Any]]:
        """Read stream messages until one satisfies ``pred``; return all read (the last one matched)."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching message in {timeout} s; got {seen[-5:]}")
            try:
                msg = self.read_message(left)
            except TimeoutError:
                raise TimeoutError(f"no matching message in {timeout} s; got {seen[-5:]}") from None
            seen.append(msg)
            if pred(msg):
                return seen


def log_lines(msg: dict[str, Any]) -> list[tuple[int, str]]:
    """The ``(offset, text)`` lines of a streamed ``log_block`` message; none for any other message."""
    if msg.get("type") != "log_block":
        return []
    texts = msg["text"].split("\n")
    offsets = msg.get("offsets") or protocol.natural_offsets(msg["offset"], msg["text"], texts)[:-1]
    return list(zip(offsets, texts, strict=True))


def decode_messages(data: bytes) -> list[dict[str, Any]]:
    """Every message in ``data`` (complete lines and their payloads), e.g. what a daemon sent."""
    out: list[dict[str, Any]] = []
    pos = 0
    while pos < len(data):
        end = data.index(b"\n", pos) + 1
        msg = protocol.decode_message(data[pos:end])
        pos = end
        size = protocol.payload_size(msg)
        if size is not None:
            msg = protocol.attach_payload(msg, data[pos : pos + size])
            pos += size
        out.append(msg)
    return out


def last_log_text(msg: dict[str, Any]) -> str | None:
    """The text of the last line of a streamed ``log_block`` message; None for any other message."""
    lines = log_lines(msg)
    return lines[-1][1] if lines else None


def state_event(state: str) -> Callable[[dict[str, Any]], bool]:
    """Predicate: a streamed journal state event with ``state``."""
    return lambda m: (
        m.get("type") == "event" and m["event"].get("type") == "state" and m["event"].get("state") == state
    )


def terminal_event(m: dict[str, Any]) -> bool:
    """Predicate: a streamed journal state event with a terminal state."""
    return (
        m.get("type") == "event"
        and m["event"].get("type") == "state"
        and m["event"].get("state") in ("completed", "failed", "stopped", "lost")
    )
