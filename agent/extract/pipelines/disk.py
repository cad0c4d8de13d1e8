"""Disk progress of a user's pipeline: its files in the output dir, free space, disk_low and an ETA.

The tools' own bars say nothing of the disk: a ``progress`` line of our own backends' shape, counting only
what this attempt wrote (files present at the start were written before).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.checks.dirs import is_capture_file
from agent.extract.planning import forecast

PROGRESS_INTERVAL_S = 30.0


def scan(out: str) -> tuple[int, int]:
    """Capture files (and their bytes) in out and one folder level below (SpecForge's rows_* groups)."""
    files = nbytes = 0
    try:
        top = list(os.scandir(out))
    except OSError:
        return 0, 0
    entries = list(top)
    for entry in top:
        # dot folders are staging areas (vLLM writes there before speculators moves the file in)
        if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
            try:
                entries.extend(os.scandir(entry.path))
            except OSError:
                continue
    for entry in entries:
        if is_capture_file(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                nbytes += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue  # moved or removed between the listing and the look
            files += 1
    return files, nbytes


@dataclass
class DiskWatch:
    """What this attempt of a pipeline has written so far, as progress fields."""

    out: str
    total: int | None  # samples this attempt processes, when known
    bytes_todo: int  # the forecast's bytes (0: unknown)
    low_bytes: int  # the spec's disk_low_gib threshold
    base: tuple[int, int] = (0, 0)
    started: float = field(default_factory=time.monotonic)

    def begin(self) -> None:
        """Count what is there before the tool starts: files of an earlier attempt are not progress."""
        self.base, self.started = scan(self.out), time.monotonic()

    def fields(self) -> dict[str, Any]:
        """The progress fields now."""
        files, nbytes = scan(self.out)
        done, written = max(files - self.base[0], 0), max(nbytes - self.base[1], 0)
        free = forecast.free_bytes(self.out)
        out: dict[str, Any] = {
            "rule": "pipeline_disk",
            "samples_done": done,
            "files_written": done,
            "bytes_written": written,
            "free_bytes": free,
            "disk_low": forecast.disk_state(free, max(self.bytes_todo - written, 0), self.low_bytes),
        }
        if self.total is not None:
            out["samples_total"] = self.total
            secs = time.monotonic() - self.started
            if done and secs > 0:
                out["eta_s"] = round(max(self.total - done, 0) * secs / done, 1)
        return out

    def start(self, stop: threading.Event, emit: Callable[..., None]) -> None:
        """begin(), then a progress line every PROGRESS_INTERVAL_S until stop is set (on a daemon thread)."""
        self.begin()

        def lines() -> None:
            while not stop.wait(PROGRESS_INTERVAL_S):
                emit("progress", **self.fields())

        threading.Thread(target=lines, daemon=True).start()
