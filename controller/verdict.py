"""Pure: a run's verdict (``ok | problems | failed``, None while it runs) in a word and a sentence, and its
shape problems grouped by kind with their files as ranges relative to the output directory."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

TERMINAL = frozenset({"completed", "failed", "stopped", "lost"})
#: Pieces a file list shows before "and N more" (the full list is one click away on the run page).
MAX_PIECES = 8
# hs_12.safetensors → ("hs_", "12", ".safetensors"); data_3.ckpt.gz → ("data_", "3", ".ckpt.gz")
_NUMBERED = re.compile(r"(?P<pre>.*?)(?P<n>\d+)(?P<suf>(?:\.[A-Za-z]\w*)*)\Z")


@dataclass(frozen=True)
class CheckTally:
    """What a run's shape checks and alerts say: files checked, those that failed, other findings."""

    checked: Sequence[str] = ()  # files checked (relative to the output directory)
    bad: Sequence[str] = ()  # of those, the ones with problems
    problems: int = 0  # problem rows, directory-level ones (index_gap) included
    alerts: int = 0  # alerts raised for the run


@dataclass
class ProblemGroup:
    """One kind of shape problem: code and message, how many files have it, which (as ranges)."""

    code: str
    message: str
    files: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        """How many files have this problem."""
        return len(self.files)

    @property
    def files_text(self) -> str:
        """The files as compact ranges: ``hs_0 … hs_23``."""
        return file_ranges(self.files)


def verdict(state: str, tally: CheckTally) -> str | None:
    """``failed`` (failed or lost), ``problems`` (ended, but files failed checks or alerts fired), ``ok``
    (ended, nothing wrong; a stop by request is no fault), None while the run is not over."""
    if state not in TERMINAL:
        return None
    if state in ("failed", "lost"):
        return "failed"
    return "problems" if tally.bad or tally.problems or tally.alerts else "ok"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def verdict_text(state: str, tally: CheckTally) -> str | None:
    """One sentence for the page, dashboard and CLI: ``completed — 24 of 24 files failed shape checks;
    no file is good``; None while the run is not over."""
    if state not in TERMINAL:
        return None
    parts: list[str] = []
    checked, bad = len(tally.checked), set(tally.bad)
    if bad:
        good = [f for f in tally.checked if f not in bad]
        said = f"{len(bad)} of {_plural(checked, 'file')} failed shape checks"
        parts.append(f"{said}; {'good: ' + file_ranges(good) if good else 'no file is good'}")
    elif checked:
        parts.append(f"{_plural(checked, 'file')} passed shape checks")
    if tally.problems and not bad:
        parts.append(f"{_plural(tally.problems, 'output problem')} (e.g. missing files)")
    if tally.alerts:
        parts.append(f"{_plural(tally.alerts, 'alert')} raised")
    return f"{state} — {'; '.join(parts)}" if parts else state


def relative(path: str, output_dir: str | None) -> str:
    """``path`` relative to the output directory when it lies inside it (``.`` is the directory itself)."""
    if path in ("", "."):
        return "."
    if output_dir:
        base = output_dir.rstrip("/") + "/"
        if path.startswith(base):
            return path[len(base) :]
        if path == output_dir.rstrip("/"):
            return "."
    return path


def file_ranges(files: Iterable[str]) -> str:
    """Numbered files as runs of consecutive indices, ``hs_0 … hs_23, hs_30`` (suffixes dropped); others
    by name; past ``MAX_PIECES`` pieces, ``and N more``."""
    series: dict[tuple[str, str], set[int]] = {}
    plain: list[str] = []
    for f in files:
        m = _NUMBERED.match(f)
        if m is None:
            plain.append(f)
        else:
            series.setdefault((m.group("pre"), m.group("suf")), set()).add(int(m.group("n")))
    pieces: list[tuple[str, int]] = []  # (text, how many files it stands for)
    for (pre, _suf), numbers in series.items():
        ordered = sorted(numbers)
        start = prev = ordered[0]
        for n in [*ordered[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            if prev == start:
                pieces.append((f"{pre}{start}", 1))
            elif prev == start + 1:
                pieces += [(f"{pre}{start}", 1), (f"{pre}{prev}", 1)]
            else:
                pieces.append((f"{pre}{start} … {pre}{prev}", prev - start + 1))
            if n is not None:
                start = prev = n
    pieces += [(p, 1) for p in sorted(set(plain))]
    shown, rest = pieces[:MAX_PIECES], pieces[MAX_PIECES:]
    text = ", ".join(p for p, _ in shown)
    if rest:
        text += f" and {sum(n for _, n in rest)} more"
    return text


def group_problems(problems: Iterable[tuple[str, str, str]], output_dir: str | None) -> list[ProblemGroup]:
    """(code, file, message) rows → one group per (code, message), first seen first; a file named in its
    own message is written ``…`` there so that the same problem in many files is one group."""
    groups: dict[tuple[str, str], ProblemGroup] = {}
    for code, file, message in problems:
        rel = relative(file, output_dir)
        said = message
        for name in sorted({file, rel, file.rsplit("/", 1)[-1]} - {"", "."}, key=len, reverse=True):
            said = said.replace(name, "…")
        group = groups.setdefault((code, said), ProblemGroup(code, said))
        if rel not in group.files:
            group.files.append(rel)
    return list(groups.values())
