"""Output-directory watching for a run: which capture files are complete, checking them, their events."""

from __future__ import annotations

import os
import re
from typing import Any


def complete_files(
    out: str,
    checked: dict[str, list[int]],
    pending: dict[str, tuple[int, int]],
    recovered: set[str],
    final: bool,
    window: tuple[int, int] | None = None,
) -> list[tuple[str, tuple[int, int]]]:
    """Capture files in ``out`` ready to check: no lock beside them and the same (size, mtime) on two looks.

    ``checked`` (name → [size, mtime_ns] already checked), ``pending`` (first look) and ``recovered`` (checked
    before a daemon crash, per the journal) are updated in place; ``final`` (the job has ended) skips the
    second look. ``window`` [start, end): a shard's own files only (other shards may share the directory).
    """
    from agent.checks.checker import is_capture_file
    from agent.checks.dirs import lock_names

    names = _listing(out)
    present = set(names)
    ready = []
    for name in names:
        folder = os.path.dirname(name)
        if not is_capture_file(name) or any(os.path.join(folder, lk) in present for lk in lock_names(name)):
            continue
        if window is not None and not in_window(name, window):
            continue
        try:
            st = os.stat(os.path.join(out, name))
        except OSError:
            continue
        sig = (st.st_size, st.st_mtime_ns)
        if checked.get(name) == list(sig):
            continue
        if name in recovered:
            recovered.discard(name)
            checked[name] = list(sig)
            continue
        if final or pending.get(name) == sig:
            ready.append((name, sig))
        else:
            pending[name] = sig
    return ready


#: SpecForge groups its files in folders of 2000: rows_0-2000/data_0.ckpt … (scripts/prepare_hidden_states.py)
GROUP_DIR = re.compile(r"^rows_\d+-\d+\Z")


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


def in_window(name: str, window: tuple[int, int]) -> bool:
    """True for an indexed capture file (hs_N, data_N) whose N lies in [start, end)."""
    from agent.checks.dirs import family

    fam = family(name)
    return fam is not None and window[0] <= fam[1] < window[1]


def shard_window(out: str, shard: tuple[int, int] | None) -> tuple[int, int] | None:
    """A shard run's [start, end), from the manifest its job writes before any file; None otherwise."""
    if shard is None:
        return None
    from pathlib import Path

    from agent.checks.dirs import shard_range

    return shard_range(Path(out), *shard)


def shard_gaps(out: str, shard: tuple[int, int]) -> list[dict[str, Any]]:
    """index_gap problems among one shard's files only (names alone: no capture file is read)."""
    from agent.checks.dirs import index_gaps

    window = shard_window(out, shard)
    if window is None:
        return []
    try:
        names = [n for n in os.listdir(out) if in_window(n, window)]
    except OSError:
        return []
    return [p.to_dict() for p in index_gaps(out, names, ranges=[window])]


def check_events(name: str, report: dict[str, Any], line: int) -> list[dict[str, Any]]:
    """The journal events for one check report: a ``check`` event, then a milestone per problem or a pass."""
    problems = list(report.get("problems") or [])
    unchecked = bool(report.get("unchecked"))
    ev: dict[str, Any] = {
        "type": "check",
        "file": name,
        "ok": bool(report.get("ok")) and not problems,
        "format": report.get("format"),
        "problems": problems,
    }
    if unchecked:
        ev["unchecked"] = report.get("unchecked")
    shapes = report.get("shapes") or {}  # what the checker read, for the run page beside what was expected
    if shapes:
        ev["shapes"] = shapes
    events = [ev]
    base = {"type": "milestone", "line": line, "rank": None}
    for p in problems:
        fields = {
            "file": p.get("file", name),
            "code": p.get("code"),
            "message": p.get("message"),
            "source": "agent",
            **({"shapes": shapes} if shapes else {}),
        }
        text = f"{p.get('code')}: {p.get('file', name)}: {p.get('message')}"
        events.append({**base, "kind": "shape_check_failed", "fields": fields, "text": text})
    if not problems and not unchecked:
        fields = {"file": name, "format": report.get("format"), "source": "agent"}
        if shapes:
            fields["shapes"] = shapes
        events.append({**base, "kind": "shape_check_passed", "fields": fields, "text": f"{name}: shapes ok"})
    return events


async def check_file(
    path: str,
    *,
    layers: int | None = None,
    hidden_size: int | None = None,
    deep: bool = True,
) -> dict[str, Any]:
    """Run the output checker on a path in a child process (keeps torch/numpy out of the daemon)."""
    from agent.checks.child import CheckPool

    pool = CheckPool(1)
    try:
        arg = {"path": path, "layers": layers, "hidden_size": hidden_size, "deep": deep}
        return (await pool.check([arg]))[0]
    finally:
        await pool.close()
