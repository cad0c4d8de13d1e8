"""The watcher's output checks: each capture file once it is complete, then the index gaps at the end.

A safetensors file whose check reads its header alone is checked in the daemon's process (in a worker
thread, a batch at a time); a file that needs numpy or torch (a value scan, a torch file) goes to the daemon's
``CheckPool`` of long-lived children, and its result comes back while the watcher goes on reading the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.checks.child import expectation, shared_pool
from agent.runs.jobspec import JobSpec
from agent.runs.outputs import check_events, complete_files, shard_gaps, shard_window

#: Files per request to a check child: one pipe round trip for many small files; the pipe holds them all.
BATCH = 64


class OutputChecks:
    """What the watcher checks of the run's output_dir: its results go to ``record`` (numbered with the
    log line ``line()`` reached), a failed check to ``on_failure``; ``advanced`` is called when a check
    done in a child comes back.

    ``checked`` (file name → [size, mtime_ns] when checked) goes into the cursor; ``recovered``: files whose
    checks the journal already holds from before a restart (taken as checked, not checked again)."""

    def __init__(
        self,
        spec: JobSpec,
        checked: dict[str, list[int]],
        recovered: set[str],
        record: Callable[[list[dict[str, Any]]], None],
        line: Callable[[], int],
        on_failure: Callable[[str], None],
        advanced: Callable[[], None],
    ) -> None:
        self.spec = spec
        self.checked = checked
        self._recovered = recovered
        self._record = record
        self._line = line
        self._on_failure = on_failure
        self._advanced = advanced
        self._pending: dict[str, tuple[int, int]] = {}  # files seen once: their size and mtime_ns then
        self._arg: dict[str, Any] = {
            "layers": spec.expect_layers,
            "hidden_size": spec.expect_hidden_size,
            "model": spec.model,
            "layer_ids": spec.layers,
        }
        self._expect: Any = None  # read from the model's config.json at the first check
        self._inflight: dict[str, asyncio.Task[None]] = {}

    @property
    def waiting(self) -> bool:
        """Whether files were seen that are not complete yet (look again soon)."""
        return bool(self._pending)

    async def scan(self, final: bool) -> bool:
        """Check each capture file once it is complete: same size on two looks and no ``.lock`` beside it;
        True when some were checked here (results from children come later, through ``advanced``)."""
        out = self.spec.output_dir
        if not out or not os.path.isdir(out):
            return False
        window = shard_window(out, self.spec.shard)
        if self.spec.shard is not None and window is None:
            return False  # a shard's job writes its manifest (its range) before any file: none yet
        ready = complete_files(out, self.checked, self._pending, self._recovered, final, window)
        ready = [(name, sig) for name, sig in ready if name not in self._inflight]
        here = await asyncio.to_thread(self._check_here, out, ready)
        for name, sig in ready:
            if name in here:
                self._done(name, sig, here[name])
        away = [(name, sig) for name, sig in ready if name not in here]
        for i in range(0, len(away), BATCH):
            batch = away[i : i + BATCH]
            task = asyncio.get_running_loop().create_task(self._check_in_child(out, batch))
            self._inflight.update((name, task) for name, _sig in batch)
        return bool(here)

    def _check_here(self, out: str, ready: list[tuple[str, tuple[int, int]]]) -> dict[str, dict[str, Any]]:
        """Reports of the files that need no tensor library, checked in this process (a worker thread)."""
        from agent.checks.checker import check_path, needs_tensor_libs

        if self._expect is None:
            self._expect = expectation(self._arg)
        reports = {}
        for name, _sig in ready:
            path = Path(out, name)
            if not needs_tensor_libs(path):
                reports[name] = check_path(path, self._expect, deep=True).to_dict()
        return reports

    async def _check_in_child(self, out: str, batch: list[tuple[str, tuple[int, int]]]) -> None:
        args = [{**self._arg, "path": os.path.join(out, name), "deep": True} for name, _sig in batch]
        try:
            reports = await shared_pool().check(args)
        finally:
            for name, _sig in batch:
                self._inflight.pop(name, None)
        for (name, sig), report in zip(batch, reports, strict=True):
            self._done(name, sig, report)
        self._advanced()

    def _done(self, name: str, sig: tuple[int, int], report: dict[str, Any]) -> None:
        self._pending.pop(name, None)  # a look while it was being checked may have noted it again
        self.checked[name] = list(sig)
        self._report(name, report)

    def _report(self, name: str, report: dict[str, Any]) -> None:
        self._record(check_events(name, report, self._line()))
        problems = list(report.get("problems") or [])
        if problems:
            p = problems[0]
            self._on_failure(f"shape check failed: {p.get('code')} in {p.get('file', name)}")

    async def drain(self) -> None:
        """Wait for every check under way (files still arriving are the next scan's)."""
        while self._inflight:
            await asyncio.gather(*set(self._inflight.values()), return_exceptions=True)

    async def close(self) -> None:
        """Give up the checks under way (the daemon's pool keeps its children for the other runs)."""
        tasks = set(self._inflight.values())
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)

    async def check_index_gaps(self) -> None:
        """Once, at the end: the whole output dir's file names, for missing hs_N/data_N indices."""
        out = self.spec.output_dir
        if not out or not os.path.isdir(out) or "." in self.checked:
            return
        self.checked["."] = [0, 0]
        if "." in self._recovered:
            return
        shard = self.spec.shard
        if shard is not None:  # its own range only: other shards may still be writing theirs
            gaps = await asyncio.to_thread(shard_gaps, out, shard)
        else:
            gaps = await asyncio.to_thread(_gaps, out)
        if gaps:
            self._report(".", {"ok": False, "format": None, "problems": gaps})


def _gaps(out: str) -> list[dict[str, Any]]:
    """index_gap problems of the whole output dir, from its files' names and sample_lengths.json."""
    from agent.checks.dirs import directory_gaps, read_sample_lengths, walk

    root = Path(out)
    lengths, _note = read_sample_lengths(root)
    return [p.to_dict() for p in directory_gaps(root, walk(root), lengths.keys())]
