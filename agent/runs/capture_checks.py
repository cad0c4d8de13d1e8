"""The watcher's output checks: each capture file once it is complete, then the index gaps at the end.

A file whose check reads a safetensors header alone is checked in a worker thread of the daemon; one that
needs numpy or torch goes to the daemon's ``CheckPool``, while the watcher goes on reading the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.checks.child import shared_pool
from agent.checks.dirs import (
    directory_gaps,
    family,
    index_gaps,
    is_capture_file,
    lock_names,
    read_sample_lengths,
    shard_range,
    walk,
)
from agent.runs.jobspec import JobSpec

#: Files per request to a check child: one pipe round trip for many small files; the pipe holds them all.
BATCH = 64
#: SpecForge groups its files in folders of 2000: rows_0-2000/data_0.ckpt … (scripts/prepare_hidden_states.py)
GROUP_DIR = re.compile(r"^rows_\d+-\d+\Z")


class OutputChecks:
    """What the watcher checks of the run's output_dir; ``advanced`` is called when a child's check is back.

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
        window = None
        if self.spec.shard is not None:
            window = shard_range(Path(out), *self.spec.shard)
            if window is None:
                return False  # a shard's job writes its manifest (its range) before any file: none yet
        ready = [(n, sig) for n, sig in self._complete(out, final, window) if n not in self._inflight]
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

    def _complete(
        self, out: str, final: bool, window: tuple[int, int] | None
    ) -> list[tuple[str, tuple[int, int]]]:
        """Capture files in ``out`` ready to check: no lock beside them and the same (size, mtime) on two
        looks (one once the job has ended: ``final``); ``window``: a shard's own [start, end) only (other
        shards may share the directory)."""
        names = _listing(out)
        present = set(names)
        ready = []
        for name in names:
            if not is_capture_file(name) or (window is not None and not _in_window(name, window)):
                continue
            folder = os.path.dirname(name)
            if any(os.path.join(folder, lk) in present for lk in lock_names(name)):
                continue
            try:
                st = os.stat(os.path.join(out, name))
            except OSError:
                continue
            sig = (st.st_size, st.st_mtime_ns)
            if self.checked.get(name) == list(sig):
                continue
            if name in self._recovered:
                self._recovered.discard(name)
                self.checked[name] = list(sig)
                continue
            if final or self._pending.get(name) == sig:
                ready.append((name, sig))
            else:
                self._pending[name] = sig
        return ready

    def _check_here(self, out: str, ready: list[tuple[str, tuple[int, int]]]) -> dict[str, dict[str, Any]]:
        """Reports of the files that need no tensor library, checked in this process (a worker thread)."""
        from agent.checks.checker import check_path, expectation, needs_tensor_libs

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
        gaps = await asyncio.to_thread(_gaps, out, self.spec.shard)
        if gaps:
            self._report(".", {"ok": False, "format": None, "problems": gaps})


def _listing(out: str) -> list[str]:
    """Names in ``out`` plus "rows_A-B/name" inside SpecForge's group folders, sorted."""
    try:
        names = os.listdir(out)
    except OSError:
        return []
    found = list(names)
    for group in names:
        if GROUP_DIR.match(group):
            try:
                found += [f"{group}/{name}" for name in os.listdir(os.path.join(out, group))]
            except OSError:
                continue
    return sorted(found)


def _in_window(name: str, window: tuple[int, int]) -> bool:
    """True for an indexed capture file (hs_N, data_N) whose N lies in [start, end)."""
    fam = family(name)
    return fam is not None and window[0] <= fam[1] < window[1]


def _gaps(out: str, shard: tuple[int, int] | None) -> list[dict[str, Any]]:
    """index_gap problems from the file names alone (no capture file is read): a shard's own range only
    (other shards may still be writing theirs), else the whole dir and its sample_lengths.json."""
    root = Path(out)
    if shard is None:
        lengths, _note = read_sample_lengths(root)
        return [p.to_dict() for p in directory_gaps(root, walk(root), lengths.keys())]
    window = shard_range(root, *shard)
    if window is None:
        return []
    try:
        names = [n for n in os.listdir(out) if _in_window(n, window)]
    except OSError:
        return []
    return [p.to_dict() for p in index_gaps(out, names, ranges=[window])]


def check_events(name: str, report: dict[str, Any], line: int) -> list[dict[str, Any]]:
    """The journal events for one check report: a ``check`` event, then a milestone per problem or a pass."""
    problems = list(report.get("problems") or [])
    unchecked = report.get("unchecked")
    # what the checker read, for the run page beside what was expected
    shapes = {"shapes": report["shapes"]} if report.get("shapes") else {}
    ev: dict[str, Any] = {
        "type": "check",
        "file": name,
        "ok": bool(report.get("ok")) and not problems,
        "format": report.get("format"),
        "problems": problems,
        **({"unchecked": unchecked} if unchecked else {}),
        **shapes,
    }
    events = [ev]
    base = {"type": "milestone", "line": line, "rank": None}
    for p in problems:
        file, code, message = p.get("file", name), p.get("code"), p.get("message")
        fields = {"file": file, "code": code, "message": message, "source": "agent", **shapes}
        events.append(
            {**base, "kind": "shape_check_failed", "fields": fields, "text": f"{code}: {file}: {message}"}
        )
    if not problems and not unchecked:
        fields = {"file": name, "format": report.get("format"), "source": "agent", **shapes}
        events.append({**base, "kind": "shape_check_passed", "fields": fields, "text": f"{name}: shapes ok"})
    return events
