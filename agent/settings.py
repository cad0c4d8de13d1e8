"""The agent's settings: every EAGLEWATCH_* variable the daemon, its jobs and their workers read, one table.

Each `Setting` has a name, a type, a default (as text, parsed like a value) and one line of doc; `get`
reads the environment when called, so a test or the job can set a variable first. A job's settings come
from the spec's `env`, which the job applies before its workers start; the workers inherit them. Settings
marked `by_agent` are set by the agent for its own job processes, never by users.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SettingError(ValueError):
    """A variable holds a value its setting cannot use; the message names the variable and the value."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: name, type, default and what it does."""

    name: str
    type: str
    parse: Callable[[str], T]  # raises ValueError saying what was expected
    default: str
    doc: str
    by_agent: bool = False

    def get(self, env: Mapping[str, str] | None = None) -> T:
        """The value in ``env`` (default os.environ), else the default; SettingError when malformed."""
        text = (os.environ if env is None else env).get(self.name, "").strip() or self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise SettingError(f"{self.name}={text!r}: {exc}") from None


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _optional(text: str) -> str | None:
    return text or None


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1 or 0")


def _names(text: str) -> frozenset[str]:
    return frozenset(x.strip() for x in text.split(",") if x.strip())


def _indices(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in text.split(",")) if text else None
    except ValueError:
        raise ValueError("expected comma-separated layer indices") from None


def _shard(text: str) -> tuple[int, int] | None:
    index, sep, count = text.partition("/")
    if not text:
        return None
    if not (sep and index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError("expected index/count with index below count")
    return int(index), int(count)


def _capture(text: str) -> str | None:
    if text and text.lower() not in ("aux", "hooks"):
        raise ValueError("expected one of aux, hooks")
    return text.lower() or None


def _number(text: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"expected a number from {low:g} to {high:g}")
    return value


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _number(text, low, high)
        if value != int(value):
            raise ValueError("expected a whole number")
        return int(value)

    return parse


# --- the daemon ---------------------------------------------------------------------------------------
AGENT_HOME = Setting(
    "EAGLEWATCH_AGENT_HOME",
    "path",
    _path,
    "~/.local/state/eaglewatch-agent",
    "daemon: its state dir, with runs, socket and lock (`--state-dir` wins)",
)
NVIDIA_SMI = Setting(
    "EAGLEWATCH_NVIDIA_SMI",
    "path",
    _optional,
    "",
    "daemon: the nvidia-smi it runs for GPU discovery (unset: the one on PATH)",
)
SLURM_POLL_S = Setting(
    "EAGLEWATCH_SLURM_POLL_S",
    "float",
    lambda text: _number(text, 0.2, 3600),
    "10",
    "daemon: seconds between its squeue calls, one call for all runs (0.2-3600)",
)
# --- the extraction job, from the spec's env ----------------------------------------------------------------
CAPTURE = Setting(
    "EAGLEWATCH_CAPTURE",
    "str",
    _capture,
    "",
    "job: the worker extension's capture path, aux (compiled, CUDA graphs) or hooks (eager); unset: chosen",
)
ALLOW_KNOWN_BUGS = Setting(
    "EAGLEWATCH_ALLOW_KNOWN_BUGS",
    "list",
    _names,
    "",
    "job: known-bug ids (comma-separated) your vLLM build has fixed: their refusal becomes a warning",
)
ALLOW_UNTESTED_VLLM = Setting(
    "EAGLEWATCH_ALLOW_UNTESTED_VLLM",
    "bool",
    _flag,
    "0",
    "job: 1 captures with a vLLM outside the checked version range",
)
PINNED_BUFFERS = Setting(
    "EAGLEWATCH_PINNED_BUFFERS",
    "int",
    _int_in(2, 64),
    "6",
    "job: pinned host buffers the GPU copies captured states into (2-64)",
)
WRITERS = Setting(
    "EAGLEWATCH_WRITERS",
    "int",
    _int_in(1, 64),
    "4",
    "job: threads writing the capture's files (1-64)",
)
WRITEBACK_MB = Setting(
    "EAGLEWATCH_WRITEBACK_MB",
    "int",
    _int_in(0, 65536),
    "1024",
    "job: capture MB on their way to disk before a writer waits (0: the kernel decides)",
)
COSTS_TRACE = Setting(
    "EAGLEWATCH_COSTS_TRACE",
    "path",
    _optional,
    "",
    "job: a file that gets one JSON row per capture step, written after the last step",
)
# --- set by the agent for its own job processes ---------------------------------------------------------
RUN_ID = Setting(
    "EAGLEWATCH_RUN_ID",
    "str",
    _optional,
    "",
    "the run id, in every job process: `stop` finds workers that left the process group by it",
    by_agent=True,
)
SHARD = Setting(
    "EAGLEWATCH_SHARD",
    "str",
    _shard,
    "",
    "`index/count` of the Slurm array task running the job: an extraction captures that shard",
    by_agent=True,
)
AUX_LAYERS = Setting(
    "EAGLEWATCH_AUX_LAYERS",
    "list",
    _indices,
    "",
    "the aux hidden-state layer indices the job asks each vLLM worker to turn on",
    by_agent=True,
)

#: The table, in the order the README lists it: every Setting above, as defined.
REGISTRY: tuple[Setting[Any], ...] = tuple(v for v in list(globals().values()) if isinstance(v, Setting))
