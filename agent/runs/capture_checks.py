"""The watcher's output checks: each capture file once it is complete, then the index gaps at the end."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from agent.runs.jobspec import JobSpec
from agent.runs.outputs import check_events, check_file, complete_files, shard_gaps, shard_window


class OutputChecks:
    """Mixed into RunWatcher: what it checks of the run's output_dir and how the results are journaled."""

    spec: JobSpec
    line: int
    checked: dict[str, list[int]]
    _checking: bool
    _pending_files: dict[str, tuple[int, int]]
    _recovered_checks: set[str]

    def _append(self, ev: dict[str, Any]) -> None:
        raise NotImplementedError

    def _save_cursor(self, force: bool = False) -> None:
        raise NotImplementedError

    def _shape_failed(self, reason: str) -> None:
        raise NotImplementedError

    async def _scan_outputs(self, final: bool) -> None:
        """Check each capture file once it is complete: same size on two looks and no ``.lock`` beside it."""
        out = self.spec.output_dir
        if not out or self._checking or not os.path.isdir(out):
            return
        window = shard_window(out, self.spec.shard)
        if self.spec.shard is not None and window is None:
            return  # a shard's job writes its manifest (its range) before any file: none of its files yet
        ready = complete_files(out, self.checked, self._pending_files, self._recovered_checks, final, window)
        if not ready:
            return
        self._checking = True
        try:
            for name, sig in ready:
                self._pending_files.pop(name, None)
                report = await self._check(os.path.join(out, name))
                self.checked[name] = list(sig)
                self._record_check(name, report)
        finally:
            self._checking = False
        self._save_cursor(force=True)

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

    def _record_check(self, name: str, report: dict[str, Any]) -> None:
        for ev in check_events(name, report, self.line):
            self._append(ev)
        problems = list(report.get("problems") or [])
        if problems:
            p = problems[0]
            self._shape_failed(f"shape check failed: {p.get('code')} in {p.get('file', name)}")

    async def _check_index_gaps(self) -> None:
        """Once, at the end: a header-only look at the whole output dir for missing hs_N/data_N indices."""
        out = self.spec.output_dir
        if not out or not os.path.isdir(out) or "." in self.checked:
            return
        self.checked["."] = [0, 0]
        if "." in self._recovered_checks:
            return
        if self.spec.shard is not None:  # its own range only: other shards may still be writing theirs
            found = await asyncio.to_thread(shard_gaps, out, self.spec.shard)
            if found:
                self._record_check(".", {"ok": False, "format": None, "problems": found})
            return
        report = await self._check(out, deep=False)
        gaps = [p for p in report.get("problems") or [] if p.get("code") == "index_gap"]
        if gaps:
            self._record_check(".", {"ok": False, "format": report.get("format"), "problems": gaps})
