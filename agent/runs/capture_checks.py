"""The watcher's output checks: each capture file once it is complete, then the index gaps at the end."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from agent.runs.jobspec import JobSpec
from agent.runs.outputs import check_events, check_file, complete_files, shard_gaps, shard_window


class OutputChecks:
    """What the watcher checks of the run's output_dir: its results go to ``record`` (numbered with the
    log line ``line()`` reached), a failed check to ``on_failure``.

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
    ) -> None:
        self.spec = spec
        self.checked = checked
        self._recovered = recovered
        self._record = record
        self._line = line
        self._on_failure = on_failure
        self._pending: dict[str, tuple[int, int]] = {}  # files seen once: their size and mtime_ns then

    @property
    def waiting(self) -> bool:
        """Whether files were seen that are not complete yet (look again soon)."""
        return bool(self._pending)

    async def scan(self, final: bool) -> bool:
        """Check each capture file once it is complete: same size on two looks and no ``.lock`` beside it;
        True when some were checked."""
        out = self.spec.output_dir
        if not out or not os.path.isdir(out):
            return False
        window = shard_window(out, self.spec.shard)
        if self.spec.shard is not None and window is None:
            return False  # a shard's job writes its manifest (its range) before any file: none yet
        ready = complete_files(out, self.checked, self._pending, self._recovered, final, window)
        for name, sig in ready:
            self._pending.pop(name, None)
            report = await self._check(os.path.join(out, name))
            self.checked[name] = list(sig)
            self._report(name, report)
        return bool(ready)

    async def _check(self, path: str, deep: bool = True) -> dict[str, Any]:
        spec = self.spec
        return await check_file(
            path,
            layers=spec.expect_layers,
            hidden_size=spec.expect_hidden_size,
            model=spec.model,
            layer_ids=spec.layers,
            deep=deep,
        )

    def _report(self, name: str, report: dict[str, Any]) -> None:
        self._record(check_events(name, report, self._line()))
        problems = list(report.get("problems") or [])
        if problems:
            p = problems[0]
            self._on_failure(f"shape check failed: {p.get('code')} in {p.get('file', name)}")

    async def check_index_gaps(self) -> None:
        """Once, at the end: a header-only look at the whole output dir for missing hs_N/data_N indices."""
        out = self.spec.output_dir
        if not out or not os.path.isdir(out) or "." in self.checked:
            return
        self.checked["."] = [0, 0]
        if "." in self._recovered:
            return
        if self.spec.shard is not None:  # its own range only: other shards may still be writing theirs
            found = await asyncio.to_thread(shard_gaps, out, self.spec.shard)
            if found:
                self._report(".", {"ok": False, "format": None, "problems": found})
            return
        report = await self._check(out, deep=False)
        gaps = [p for p in report.get("problems") or [] if p.get("code") == "index_gap"]
        if gaps:
            self._report(".", {"ok": False, "format": report.get("format"), "problems": gaps})
