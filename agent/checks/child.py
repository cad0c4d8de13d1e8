"""Checks in long-lived child processes: the child's loop (``python -m agent.checks.child``) and the pool.

The daemon never imports torch or numpy: checks that need them run in a child that reads one JSON request
per line on stdin — {"path", "layers"?, "hidden_size"?, "model"?, "layer_ids"?, "deep"? (default true)} —
and writes one report per line on stdout, until stdin closes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
import weakref
from typing import Any

#: A check that takes longer than this is given up (its child killed) and the file left unchecked.
CHECK_TIMEOUT_S = 300.0
#: The bytes of a child's stderr kept to explain a child that died.
STDERR_TAIL = 300


def pool_size() -> int:
    """Children for the daemon's value scans, all runs together: scans read at disk speed, and the host's
    CPUs are the jobs'."""
    return max(1, min(2, (os.cpu_count() or 1) // 4))


#: The daemon's one pool, per event loop (its semaphore and pipes belong to the loop that made them).
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CheckPool] = weakref.WeakKeyDictionary()


def shared_pool() -> CheckPool:
    """The one pool of this daemon's event loop, shared by every run (idle children stay for more files)."""
    loop = asyncio.get_running_loop()
    if (pool := _POOLS.get(loop)) is None:
        pool = _POOLS[loop] = CheckPool(pool_size())
    return pool


def unchecked(path: str, message: str) -> dict[str, Any]:
    """A report for a file no check could judge (not a problem of the file, not a pass either)."""
    return {
        "ok": False,
        "files": 0,
        "format": None,
        "problems": [],
        "unchecked": [os.path.basename(path)],
        "error": message,
    }


def answer(line: str) -> dict[str, Any]:
    """The report for one request line; a bad request gets an unchecked report naming what is wrong."""
    from agent.checks.checker import check_path, expectation

    try:
        arg = json.loads(line)
        if not isinstance(arg, dict) or not isinstance(arg.get("path"), str):
            raise ValueError("expected a JSON object with a string 'path'")
    except ValueError as exc:
        return unchecked("", f"bad check request: {exc}")
    return check_path(arg["path"], expectation(arg), deep=bool(arg.get("deep", True))).to_dict()


class _Child:
    """One running checker child and the tail of its stderr."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stderr: collections.deque[bytes] = collections.deque(maxlen=8)
        self._drain = asyncio.get_running_loop().create_task(self._read_stderr())

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(4096):
            self.stderr.append(chunk)

    async def send(self, requests: list[bytes]) -> bool:
        """Write ``requests`` at once (the child answers them in order); False when it is gone."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(b"".join(requests))
            await self.proc.stdin.drain()
        except ConnectionError:
            return False
        return True

    async def reply(self) -> dict[str, Any] | None:
        """The next report, or None when the child died or answered nonsense."""
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        try:
            report = json.loads(line)
        except ValueError:
            return None
        return report if isinstance(report, dict) else None

    async def close(self) -> None:
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await self._drain


class CheckPool:
    """At most ``size`` checker children, started when first needed and kept until ``close``."""

    def __init__(self, size: int) -> None:
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()

    async def _take(self) -> _Child:
        while self._idle:
            child = self._idle.pop()
            if child.proc.returncode is None:
                return child
            await self._drop(child)  # died while idle (killed for memory, say): start another
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent.checks.child",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        child = _Child(proc)
        self._all.add(child)
        return child

    async def _drop(self, child: _Child) -> None:
        self._all.discard(child)
        if child.proc.returncode is None:
            child.proc.kill()
        await child.close()

    async def check(self, args: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The reports of checking each ``arg["path"]``, in order (see the module docstring for ``arg``).

        The requests go to one child at once: a reply per file is a pipe's round trip, not a process."""
        paths = [str(arg.get("path", "")) for arg in args]
        async with self._slots:
            child = await self._take()
            reports: list[dict[str, Any]] = []
            try:
                if await child.send([(json.dumps(arg) + "\n").encode() for arg in args]):
                    for _ in paths:
                        async with asyncio.timeout(CHECK_TIMEOUT_S):
                            report = await child.reply()
                        if report is None:
                            break
                        reports.append(report)
            except TimeoutError:
                await self._drop(child)
                late = f"the check took longer than {CHECK_TIMEOUT_S:.0f} s"
                return reports + [unchecked(p, late) for p in paths[len(reports) :]]
            except BaseException:  # cancelled mid-batch: its replies would answer the next batch
                await self._drop(child)
                raise
            if len(reports) < len(paths):
                await self._drop(child)
                tail = b"".join(child.stderr)[-STDERR_TAIL:].decode("utf-8", "replace")
                why = f"checker failed: {tail}"
                return reports + [unchecked(p, why) for p in paths[len(reports) :]]
            self._idle.append(child)
            return reports

    async def close(self) -> None:
        """End every child (they exit when their stdin closes)."""
        children, self._all, self._idle = list(self._all), set(), []
        await asyncio.gather(*(c.close() for c in children))


async def check_file(path: str, *, layers: int | None, hidden_size: int | None) -> dict[str, Any]:
    """The report of checking ``path`` in a child process of its own (keeps torch/numpy out of the daemon)."""
    pool = CheckPool(1)
    try:
        return (await pool.check([{"path": path, "layers": layers, "hidden_size": hidden_size}]))[0]
    finally:
        await pool.close()


def main() -> None:
    """The child: a report line for each request line until stdin ends; anything a library prints goes to
    stderr instead."""
    replies, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        if line.strip():
            replies.write(json.dumps(answer(line)) + "\n")
            replies.flush()


if __name__ == "__main__":
    main()
