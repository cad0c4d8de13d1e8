"""What a terminal shows of a run (``runs logs``, the demo): marker lines in words, one line per batch.

Pure: feed it log lines (``line``) or milestones (``milestone``) in order; it returns the lines to print,
each with the milestone kind it came from (None for a plain log line).  ``EAGLEWATCH {"kind": …}`` markers
become sentences; a passing shape check prints nothing but is counted into its batch's line; a batch's
``batch_captured`` and the ``progress`` right after it become one line.  The job also states that progress
as an ``[eaglewatch] N/M samples, …`` line, which is dropped after the marker it repeats.  Call ``flush``
when the input pauses or ends, so a batch line waiting for its progress is not held back.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

MARKER = "EAGLEWATCH "
_JOB_PROGRESS = re.compile(r"^\[eaglewatch\] \d+/\d+ samples, ")
# vLLM's log prefix: "(EngineCore_DP0 pid=12) INFO 12-02 11:00:00 [core.py:75] "; the message follows it
_VLLM_PREFIX = re.compile(
    r"^(?:\([\w ]+pid=\d+\)\s*)?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\]\s*"
)
#: A line read from another program's log is shown up to this many characters, cut at a word.
LOG_LINE_CHARS = 140
Shown = tuple[str, str | None]


def parse_marker(text: str) -> tuple[str, dict[str, Any]] | None:
    """(kind, fields) of a marker line (any prefix before ``EAGLEWATCH {``), else None."""
    at = text.find(MARKER + "{")
    if at < 0:
        return None
    try:
        data = json.loads(text[at + len(MARKER) :])
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        return None
    kind = data.pop("kind")
    return kind, data


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _progress(f: dict[str, Any]) -> str:
    done, total = f.get("samples_done"), f.get("samples_total")
    text = f"{_num(done)}/{_num(total)} samples" if total is not None else f"{_num(done)} samples"
    if f.get("tokens_per_s") is not None:
        text += f", {_num(f['tokens_per_s'])} tokens/s"
    return text


def words(kind: str, f: dict[str, Any]) -> str:
    """One sentence for a milestone's fields."""
    if kind == "batch_captured":
        return (
            f"batch {f.get('batch')} captured: {_num(f.get('samples'))} files, {_num(f.get('tokens'))} tokens"
        )
    if kind == "progress":
        return "progress: " + _progress(f)
    if kind == "shape_check_failed":
        return f"shape check FAILED: {f.get('file')}: {f.get('message') or f.get('code')}"
    if kind == "shape_check_passed":
        return f"shape check passed: {f.get('file')}"
    if kind == "capture_configured":
        return (
            f"capturing layers {f.get('layers')} ({f.get('convention')} convention), hidden size "
            f"{f.get('hidden_size')}, {f.get('dtype')}, backend {f.get('backend')}"
        )
    if kind == "engine_config":
        return f"engine: {f.get('platform')}, vLLM {f.get('vllm')}, model runner {f.get('model_runner')}"
    if kind == "completed":
        parts = [f"{_num(f[k])} {k}" for k in ("samples", "files", "tokens") if f.get(k) is not None]
        secs = f" in {_num(float(f['seconds']))} s" if isinstance(f.get("seconds"), (int, float)) else ""
        return "completed: " + (", ".join(parts) or "done") + secs
    if kind == "failed":
        return f"failed: {f.get('reason')}"
    if kind == "warning" and f.get("message"):
        return f"warning: {f['message']}"
    shown = ", ".join(f"{k} {_num(v)}" for k, v in f.items() if k != "source")
    return f"{kind.replace('_', ' ')}: {shown}" if shown else kind.replace("_", " ")


def exit_words(exit: dict[str, Any] | None) -> str | None:
    """A job's exit status in words (``exit code 2``, ``killed by signal 9``); None when unknown."""
    if not exit:
        return None
    if exit.get("signal") is not None:
        return f"killed by signal {exit['signal']}"
    return f"exit code {exit['code']}" if exit.get("code") is not None else None


class TerminalView:
    """Turns a run's log lines or milestones into what a terminal shows (see the module docstring)."""

    def __init__(self) -> None:
        self._passed = 0
        self._batch: dict[str, Any] | None = None
        self._after_progress = False

    def line(self, text: str) -> list[Shown]:
        """What to print for one log line."""
        marker = parse_marker(text)
        if marker is not None:
            return self.milestone(*marker)
        if self._after_progress and _JOB_PROGRESS.match(text):
            self._after_progress = False
            return []
        self._after_progress = False
        return [*self.flush(), (text, None)]

    def milestone(self, kind: str, fields: dict[str, Any]) -> list[Shown]:
        """What to print for one milestone (from a marker line or from the controller's feed)."""
        self._after_progress = kind == "progress"
        if kind == "shape_check_passed":
            self._passed += 1
            return []
        if kind == "batch_captured":
            out = self.flush()
            self._batch = fields
            return out
        if kind == "progress" and self._batch is not None:
            batch, self._batch = self._batch, None
            return [(f"{self._batch_words(batch)}; {_progress(fields)}", "batch_captured")]
        return [*self.flush(), (words(kind, fields), kind)]

    def stored(self, kind: str, fields: dict[str, Any], text: str) -> list[Shown]:
        """What to print for a stored milestone: a marker's in words, one read from another program's log
        (vLLM's) by its kind and the start of its line."""
        if parse_marker(text) is not None:
            return self.milestone(kind, fields)
        first = _VLLM_PREFIX.sub("", text.splitlines()[0]) if text.strip() else ""
        shown = textwrap.shorten(first, LOG_LINE_CHARS, placeholder=" …")
        return [*self.flush(), (f"{kind.replace('_', ' ')}: {shown}", kind)]

    def flush(self) -> list[Shown]:
        """The batch line still waiting for its progress, if any."""
        if self._batch is None:
            return []
        batch, self._batch = self._batch, None
        return [(self._batch_words(batch), "batch_captured")]

    def _batch_words(self, fields: dict[str, Any]) -> str:
        passed, self._passed = self._passed, 0
        checks = f", {passed} passed shape check{'' if passed == 1 else 's'}" if passed else ""
        return words("batch_captured", fields) + checks
