"""Shared pieces of the ``eaglewatch`` command: consoles, styles, the short-lived controller runner."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from controller.errors import ControllerError, SpecInvalid
from controller.settings import Settings

T = TypeVar("T")
#: ``--json``: the record as JSON for scripts, in place of words.
JSON_FLAG = typer.Option("--json", help="print JSON for scripts instead of words")
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
STATE_STYLE = {
    "running": "cyan",
    "completed": "green",
    "failed": "red",
    "stopped": "yellow",
    "lost": "red",
    "unknown": "magenta",
    "pending": "dim",
    "starting": "blue",
}
#: A run's verdict wins over its state's colour: a completed run whose files failed checks is no success.
VERDICT_STYLE = {"ok": "green", "problems": "bold yellow", "failed": "red"}


def run_state_text(state: str, verdict: str | None, verdict_text: str | None) -> Text:
    """A run's state for the terminal: the verdict sentence once it has ended, in the verdict's colour."""
    style = VERDICT_STYLE.get(verdict or "", STATE_STYLE.get(state, ""))
    return Text(verdict_text or state, style=style)


MILESTONE_STYLE = {
    "error": "bold red",
    "failed": "bold red",
    "shape_check_failed": "bold red",
    "warning": "yellow",
    "completed": "bold green",
    "shape_check_passed": "green",
}


def run_ctl(fn: Callable[[Any], Awaitable[T]], **kwargs: Any) -> T:
    """Run ``fn(controller)`` in a short-lived controller (on config.toml + environment); typed errors become
    a message and exit code."""
    from controller.service import Controller  # imported when used: a fast --help

    async def main() -> T:
        async with Controller(Settings(), **{"supervise": False, **kwargs}) as ctl:
            return await fn(ctl)

    try:
        return asyncio.run(main())
    except SpecInvalid as exc:
        invalid(exc)
    except ControllerError as exc:
        err.print(Text(f"error: {exc.message}", style="red"))
        raise typer.Exit(1) from None


def invalid(exc: SpecInvalid) -> NoReturn:
    """Print each field error and exit 2 (bad input)."""
    for e in exc.errors:
        err.print(Text(f"error: {e['field']}: {e['message']}", style="red"))
    raise typer.Exit(2)


def print_json(obj: Any) -> None:
    """Print JSON for scripts (no rich markup, no wrapping)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def shard_lines(shards: list[Any]) -> list[Text]:
    """A sharded run's shard table for the terminal: one line per shard (ShardPublic items)."""
    lines = []
    for s in shards:
        p = s.progress or {}
        done = f"{p.get('samples_done', 0)}/{p.get('samples_total', '?')}" if p else "—"
        gpus = ",".join(map(str, s.gpus)) if s.gpus else "—"
        again = f", attempt {s.attempts}" if s.attempts > 1 else ""
        lines.append(
            Text.assemble(
                f"  shard {s.index}  {s.host}  GPUs {gpus}  ",
                (s.state, STATE_STYLE.get(s.state, "")),
                f"  {done}  {s.last_milestone or ''}  job {s.job_id}{again}",
            )
        )
    return lines
