"""Where a run may write: the output_dir rules shared by the spec (pydantic), JobSpec and the daemon's launch.

``output_dir_error`` is pure (the path's text alone); ``launch_output_dir_error`` looks at the host: the
agent's state dir, the other runs' output dirs, and what the directory already holds.  A directory is
acceptable when it is missing, empty, or holds only what an extraction writes (then the run resumes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import PurePosixPath

#: What an extraction (or a capture command) leaves in its output dir: resuming into it is fine.
OWN_FILE = re.compile(
    r"^(?:hs_\d+\.safetensors(?:\.zst)?(?:\.lock|\.\d+\.tmp)?"
    r"|data_\d+\.(?:pt|ckpt|ckpt\.gz)(?:\.lock)?"
    r"|manifest[^/]*\.json"
    r"|sample_lengths\.json"
    r"|layer_stats\.jsonl"
    r"|\.staging-[^/]*"
    r"|rows_\d+-\d+|vocab_mapping"  # SpecForge's group folders and its vocabulary mapping
    r"|\.(?:hs_\d+\.safetensors|manifest[^/]*\.json)[^/]*\.tmp)$"
)


def output_dir_error(value: str) -> str | None:
    """Why ``value`` cannot be an output dir from its text alone (None when it can)."""
    if "\x00" in value or not PurePosixPath(value).is_absolute():
        return f"output_dir must be an absolute path on the host, got {value[:200]!r}"
    if ".." in PurePosixPath(value).parts:
        return f"output_dir must not contain '..', got {value[:200]!r}"
    if os.path.normpath(value) in ("/", "//"):
        return "output_dir must not be the root directory '/'"
    return None


def _within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` or lies under it (both resolved)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def foreign_files(out: str) -> list[str]:
    """Names in ``out`` that an extraction does not write (empty when ``out`` is missing or not readable)."""
    try:
        names = sorted(os.listdir(out))
    except OSError:
        return []
    return [n for n in names if OWN_FILE.match(n) is None]


def launch_output_dir_error(value: str, state_dir: str, other_runs: Iterable[tuple[str, str]]) -> str | None:
    """Why a launch must refuse ``value`` as output_dir on this host; ``other_runs`` is (run, output_dir)."""
    err = output_dir_error(value)
    if err is not None:
        return err
    out = os.path.realpath(value)
    state = os.path.realpath(state_dir)
    if _within(out, state) or _within(state, out):
        return f"output_dir {value[:200]!r} overlaps the agent's state directory {state_dir!r}"
    for run, other in other_runs:
        if other and (_within(out, os.path.realpath(other)) or _within(os.path.realpath(other), out)):
            return f"output_dir {value[:200]!r} overlaps the output directory of run {run!r}"
    if os.path.lexists(value) and not os.path.isdir(value):
        return f"output_dir {value[:200]!r} exists and is not a directory"
    foreign = foreign_files(value)
    if foreign:
        shown = ", ".join(repr(n[:80]) for n in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        return (
            f"output_dir {value[:200]!r} holds files the run did not write ({shown}{more}); "
            "use an empty or new directory, or the output dir of the run being resumed"
        )
    return None
