"""Directory-level output checks: which files are capture files, locks, index gaps, sample_lengths.json."""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from agent.checks.shapes import Problem

CAPTURE = re.compile(
    r"^(?:(?P<hs>hs)_(?P<hs_i>\d+)\.safetensors(?:\.zst)?"
    r"|(?P<data>data)_(?P<data_i>\d+)\.(?P<ext>pt|ckpt|ckpt\.gz)"
    r"|[^/]+\.safetensors(?:\.zst)?"
    r"|[^/]+\.pt)\Z"  # Model-Optimizer: {conversation_id}.pt
)
SAMPLE_LENGTHS = "sample_lengths.json"  # speculators: {"<idx>": tokens} beside data_<idx>.pt
MERGED_MANIFEST = "manifest.json"
#: What one shard of a sharded extraction writes beside its files (merged by agent/extract/writing/shards.py).
SHARD_MANIFEST = re.compile(r"^manifest\.shard-(?P<index>\d+)-of-(?P<count>\d+)\.json\Z")
_MAX_LENGTHS_BYTES = 64 << 20


def is_capture_file(name: str) -> bool:
    """True for file names a capture run writes: hs_N/*.safetensors[.zst], data_N.ckpt[.gz], *.pt."""
    base = os.path.basename(name)
    return not base.startswith(".") and CAPTURE.match(base) is not None


def family(name: str) -> tuple[str, int] | None:
    """('hs_{}.safetensors', N) / ('data_{}.pt', N) / ('data_{}.ckpt', N) for indexed names, else None."""
    m = CAPTURE.match(os.path.basename(name))
    if m is None:
        return None
    if m["hs"]:
        return "hs_{}.safetensors", int(m["hs_i"])
    if m["data"]:
        return "data_{}." + ("pt" if m["ext"] == "pt" else "ckpt"), int(m["data_i"])
    return None


def lock_names(name: str) -> tuple[str, ...]:
    """Names of the lock files that mean `name` is still being written."""
    # vLLM's connector holds "<file>.lock"; other writers lock "<stem>.lock" or the uncompressed name
    names = (name + ".lock", name.split(".", 1)[0] + ".lock", name.removesuffix(".zst") + ".lock")
    return tuple(dict.fromkeys(names))


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def walk(root: Path) -> list[tuple[Path, bool]]:
    """Every capture file under root (hidden directories skipped), in natural order, with its locked flag."""
    found: list[tuple[Path, bool]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        names = set(filenames)
        for name in sorted(filenames, key=_natural):
            if is_capture_file(name):
                found.append((Path(dirpath) / name, any(lk in names for lk in lock_names(name))))
    return found


def _spans(ids: set[int], listed: Collection[int]) -> list[tuple[int, int]]:
    # from the sorted ids, never from range(lo, hi): a stray hs_99999999999 must not cost a billion steps
    ordered = sorted(ids)
    spans = [(a + 1, b - 1) for a, b in itertools.pairwise(ordered) if b - a > 1]
    spans += [(i, i) for i in set(listed) - ids]
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _ranges(spans: list[tuple[int, int]], family: str) -> str:
    prefix = family.split("{}")[0]
    words = [f"{prefix}{a}" if a == b else f"{prefix}{a}–{prefix}{b}" for a, b in spans[:10]]
    return ", ".join(words) + (f", … ({len(spans) - 10} more ranges)" if len(spans) > 10 else "")


def _groups(
    ids: set[int], listed: Collection[int], ranges: Collection[tuple[int, int]]
) -> list[tuple[set[int], list[int]]]:
    # (ids, listed) per shard range holding files, plus those outside every range (checked as before shards)
    groups: list[tuple[set[int], list[int]]] = []
    rest, rest_listed = set(ids), list(listed)
    for start, end in ranges:
        inside = {i for i in ids if start <= i < end}
        rest -= inside
        rest_listed = [i for i in rest_listed if not start <= i < end]
        if inside:
            groups.append((inside, [i for i in listed if start <= i < end]))
    return [*groups, (rest, rest_listed)]


def index_gaps(
    root: str, names: list[str], listed: Collection[int] = (), ranges: Collection[tuple[int, int]] = ()
) -> list[Problem]:
    """index_gap problems: holes between the lowest and highest hs_N / data_N index (pure).

    listed: indices a manifest (sample_lengths.json) says exist; those missing count too, so a crash that
    lost the last files shows up as well. ranges: [start, end) of each shard whose files the directory
    holds; holes are looked for inside each range only, so the other shards' ranges are not missing.
    """
    families: dict[str, set[int]] = {}
    for name in names:
        fam = family(name)
        if fam is not None:
            families.setdefault(fam[0], set()).add(fam[1])
    problems = []
    for fam_name, ids in sorted(families.items()):
        groups = _groups(ids, listed, ranges)
        spans = sorted(span for group, wanted in groups for span in _spans(group, wanted))
        if spans:
            n = sum(b - a + 1 for a, b in spans)
            everything = ids | set(listed)
            span = f"{fam_name.format(min(everything))} … {fam_name.format(max(everything))}"
            source = f" ({SAMPLE_LENGTHS} lists {len(listed)})" if listed else ""
            problems.append(
                Problem(
                    "index_gap",
                    root,
                    f"index gap: {n} file{'s' if n > 1 else ''} missing in {span}: "
                    + _ranges(spans, fam_name)
                    + source,
                )
            )
    return problems


def _manifest_range(folder: Path, name: str) -> tuple[int, int] | None:
    # [start, end) a shard manifest records; None when it is missing, unreadable or not plausible
    path = folder / name
    try:
        if escapes(path, folder) or path.stat().st_size > _MAX_LENGTHS_BYTES:
            return None
        shard = json.loads(path.read_text(encoding="utf-8"))["shard"]
        start, end = shard["start"], shard["end"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if isinstance(start, int) and isinstance(end, int) and 0 <= start <= end:
        return start, end
    return None


def shard_range(folder: Path, index: int, count: int) -> tuple[int, int] | None:
    """[start, end) of shard index of count, from its manifest in folder (None until the job wrote it)."""
    return _manifest_range(folder, f"manifest.shard-{index}-of-{count}.json")


def shard_ranges(folder: Path) -> list[tuple[int, int]]:
    """[start, end) of each shard manifest in folder; none once a merged manifest.json checks it whole."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    if MERGED_MANIFEST in names:
        return []
    found = (_manifest_range(folder, n) for n in names if SHARD_MANIFEST.match(n) is not None)
    return sorted(r for r in found if r is not None)


def escapes(path: Path, root: Path) -> bool:
    """True when ``path`` is a symbolic link whose target lies outside ``root``.

    A dangling link resolves as far as it can: one into ``root`` is a file that vanished (moved away
    mid-walk), which the checker reports as unchecked, not as an escape.
    """
    if not path.is_symlink():
        return False
    target = os.path.realpath(path)
    top = os.path.realpath(root)
    return not (target == top or target.startswith(top.rstrip("/") + "/"))


def read_sample_lengths(folder: Path) -> tuple[dict[int, int], str | None]:
    """The {index: tokens} manifest in folder, if any, and a note when it exists but cannot be used."""
    path = folder / SAMPLE_LENGTHS
    if escapes(path, folder):
        return {}, f"{path}: ignored, a symbolic link pointing outside {folder} (not followed)"
    try:
        if path.stat().st_size > _MAX_LENGTHS_BYTES:
            return {}, f"{path}: ignored, larger than {_MAX_LENGTHS_BYTES >> 20} MiB"
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:
        return {}, f"{path}: ignored, not readable JSON ({e})"
    if not isinstance(raw, dict):
        return {}, f"{path}: ignored, expected an object of index -> length"
    out: dict[int, int] = {}
    for key, value in raw.items():
        if not (str(key).isdigit() and isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return {}, f"{path}: ignored, entry {key!r}: {value!r} is not index -> token count"
        out[int(key)] = value
    return out, None


def length_problem(file: str, tokens: int | None, lengths: dict[int, int]) -> list[Problem]:
    """seq_len_mismatch when a file's token count differs from what sample_lengths.json recorded for it."""
    fam = family(file)
    if fam is None or tokens is None or fam[1] not in lengths or lengths[fam[1]] == tokens:
        return []
    want = lengths[fam[1]]
    return [Problem("seq_len_mismatch", file, f"{tokens} tokens but {SAMPLE_LENGTHS} records {want}")]


def directory_gaps(root: Path, entries: list[tuple[Path, bool]], listed: Collection[int]) -> list[Problem]:
    """index_gap problems of a directory from its capture files' names alone (``walk`` gives ``entries``)."""
    return index_gaps(str(root), [str(f) for f, _ in entries], listed=listed, ranges=shard_ranges(root))
