"""``eaglewatch-agent connect``: bridge stdin/stdout to the daemon's socket, starting the daemon if needed."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

START_TIMEOUT_S = 15.0


def try_connect(socket_path: Path) -> socket.socket | None:
    """A connected socket, or None when no daemon answers there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(socket_path))
    except OSError:
        sock.close()
        return None
    return sock


def ensure_daemon(state_dir: Path, socket_path: Path) -> socket.socket:
    """Connect to the daemon, starting one first if nobody answers; raises ConnectionError on failure."""
    sock = try_connect(socket_path)
    if sock is not None:
        return sock
    # detached from this process (new session, no stdio of ours): it outlives SSH
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    where = ["--state-dir", str(state_dir), "--socket", str(socket_path)]
    with open(state_dir / "daemon.log", "ab") as err:
        subprocess.Popen(
            [sys.executable, "-m", "agent", "daemon", *where],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        sock = try_connect(socket_path)
        if sock is not None:
            return sock
    raise ConnectionError(f"no daemon answers on {socket_path} (see {state_dir / 'daemon.log'})")


def bridge(sock: socket.socket) -> int:
    """Copy stdin → socket (in a thread) and socket → stdout until the daemon closes the connection."""
    stdin_fd, stdout_fd = sys.stdin.fileno(), sys.stdout.fileno()

    def pump_in() -> None:
        try:
            while data := os.read(stdin_fd, 65536):
                sock.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # the daemon answers what is in flight, then hangs up

    threading.Thread(target=pump_in, daemon=True, name="stdin").start()
    try:
        while data := sock.recv(65536):
            view = memoryview(data)
            while view:
                view = view[os.write(stdout_fd, view) :]
    except (BrokenPipeError, ConnectionResetError):
        return 1
    finally:
        sock.close()
    return 0


def run_connect(state_dir: Path, socket_path: Path) -> int:
    """The ``connect`` command."""
    try:
        sock = ensure_daemon(state_dir, socket_path)
    except ConnectionError as exc:
        print(f"eaglewatch-agent connect: {exc}", file=sys.stderr)
        return 1
    return bridge(sock)
