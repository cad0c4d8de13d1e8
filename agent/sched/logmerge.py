"""Array task logs merged into the run's one output.log, each line tagged ``[shard I] ``, exactly once.

Tasks of an array job may run on different nodes: each writes its own ``output.task-I.log`` on the shared
filesystem (appending to one file from several nodes is not safe on NFS). The daemon copies their complete
lines into output.log, which the run's watcher follows as for any job. Exactly once across a daemon crash:
before each append, ``merge.json`` records where output.log ended and which bytes of which task go next;
a restarted merger cuts output.log back to that end and appends them again.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent.paths import RunPaths, atomic_write_json, read_json

_SHARD_RE = re.compile(r"\[shard ([0-9]+)\] ")
READ_CHUNK = 256 * 1024


def shard_of(text: str) -> tuple[int | None, str]:
    """(shard index, line without its tag) of a merged line; (None, text) for an untagged one."""
    m = _SHARD_RE.match(text)
    return (None, text) if m is None else (int(m.group(1)), text[m.end() :])


class LogMerger:
    """Follows the task logs of one array run and appends their lines to output.log."""

    def __init__(self, paths: RunPaths, count: int) -> None:
        self.paths = paths
        self.count = count
        self.state_path = paths.dir / "merge.json"
        saved = read_json(self.state_path)
        saved = saved if isinstance(saved, dict) else {}
        self.offsets = [int(x) for x in saved.get("offsets", [0] * count)][:count]
        self.offsets += [0] * (count - len(self.offsets))
        intent = saved.get("intent")
        if isinstance(intent, dict):
            self._redo(intent)

    def _task_log(self, task: int) -> Path:
        return self.paths.dir / f"output.task-{task}.log"

    def _redo(self, intent: dict[str, object]) -> None:
        """Finish the append a crash interrupted: cut output.log to where it ended and append again."""
        base, task, end = intent.get("base"), intent.get("task"), intent.get("end")
        if not (isinstance(base, int) and isinstance(task, int) and isinstance(end, int)):
            return
        fd = os.open(self.paths.log, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size > base:
                os.ftruncate(fd, base)
        finally:
            os.close(fd)
        self._append(task, self.offsets[task], end)

    def _append(self, task: int, start: int, end: int) -> None:
        with open(self._task_log(task), "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        tag = f"[shard {task}] ".encode()
        out = b"".join(
            tag + line + (b"" if line.endswith(b"\n") else b"\n") for line in data.splitlines(True)
        )
        fd = os.open(self.paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, out)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.offsets[task] = end
        atomic_write_json(self.state_path, {"offsets": self.offsets})

    def pump(self, final: bool = False) -> bool:
        """Append what the task logs gained (complete lines; all of it when ``final``); True if anything."""
        moved = False
        for task in range(self.count):
            try:
                size = os.path.getsize(self._task_log(task))
            except OSError:
                continue
            start = self.offsets[task]
            if size <= start:
                continue
            with open(self._task_log(task), "rb") as f:
                f.seek(start)
                data = f.read(min(size - start, READ_CHUNK))
            cut = len(data) if final and start + len(data) == size else data.rfind(b"\n") + 1
            if cut <= 0:
                continue
            end = start + cut
            try:
                base = os.path.getsize(self.paths.log)
            except OSError:
                base = 0
            atomic_write_json(
                self.state_path, {"offsets": self.offsets, "intent": {"base": base, "task": task, "end": end}}
            )
            self._append(task, start, end)
            moved = True
        return moved
