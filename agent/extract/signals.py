"""Machine-readable `EAGLEWATCH {json}` milestone lines and human-readable lines on stdout, flushed each."""

from __future__ import annotations

import json
import sys
from typing import Any

PREFIX = "EAGLEWATCH "
KINDS = frozenset(
    {
        "engine_config",
        "forecast",
        "canary_checked",
        "warning",
        "capture_configured",
        "batch_captured",
        "shape_check_passed",
        "shape_check_failed",
        "progress",
        "completed",
        "failed",
    }
)


def format_line(kind: str, **fields: Any) -> str:
    """One machine-readable line: `EAGLEWATCH {"kind": kind, ...fields}` (no newline)."""
    if kind not in KINDS:
        raise ValueError(f"unknown milestone kind {kind!r}")
    return PREFIX + json.dumps({"kind": kind, **fields}, separators=(", ", ": "), default=str)


def emit(kind: str, **fields: Any) -> None:
    """Print one milestone line and flush it (the agent follows the log live)."""
    print(format_line(kind, **fields), flush=True)


def say(message: str) -> None:
    """Print one human-readable line, prefixed so it is easy to find in a mixed vLLM log."""
    print(f"[eaglewatch] {message}", flush=True)


def cannot_start(reason: object, failed: bool = True) -> int:
    """Exit status 2 of a job that cannot start: the reason on stderr and (``failed``) in a `failed` line."""
    print(f"eaglewatch extract: error: {reason}", file=sys.stderr, flush=True)
    if failed:
        emit("failed", reason=str(reason))
    return 2
