"""`eaglewatch-agent check PATH`: check capture files offline. Exit 0 all good, 1 problems, 2 cannot run."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TextIO

from agent.checks.checker import CheckReport, check_path, expectation

EXIT_OK, EXIT_PROBLEMS, EXIT_CANNOT_RUN = 0, 1, 2
MAX_LINES = 50  # problems printed one per line; a run with the same fault in every file gets a summary


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so run() can return 2 with its own message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def parse_layers(text: str) -> list[int]:
    """Parse '2,30,58,61' into layer ids; ValueError naming the bad part."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise ValueError(f"--layers {text!r}: expected comma-separated layer ids like 2,30,58,61")
    for p in parts:
        if not p.isdigit():
            raise ValueError(f"--layers {text!r}: {p!r} is not a non-negative integer")
    ids = [int(p) for p in parts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"--layers {text!r}: a layer id is repeated")
    return ids


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `eaglewatch-agent check`."""
    p = _Parser(prog="eaglewatch-agent check", description="Check captured hidden-state files.")
    p.add_argument("path", metavar="PATH", help="a capture file or a directory of them")
    p.add_argument(
        "--layers", help="captured layer ids, e.g. 2,30,58,61 (expected layer count = their number)"
    )
    p.add_argument("--hidden-size", type=int, help="expected hidden size")
    p.add_argument(
        "--model", help="model directory: hidden size from its config.json (4 layers unless --layers)"
    )
    p.add_argument("--shallow", action="store_true", help="shapes only: skip the NaN/Inf and all-zero scans")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _safe(text: str) -> str:
    # file and tensor names come from disk: keep terminal control characters out of the output
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def _rel(file: str, root: Path) -> str:
    try:
        rel = Path(file).relative_to(root)
    except ValueError:
        return file
    return str(rel) if str(rel) != "." else file


def render(report: CheckReport, root: Path, out: TextIO) -> None:
    """Human-readable report: a summary line, one line per problem, what was unchecked, notes, verdict."""
    fmt = f" ({report.format})" if report.format else ""
    out.write(f"{_safe(str(root))}: {report.files} file{'s' if report.files != 1 else ''} checked{fmt}\n")
    for p in report.problems[:MAX_LINES]:
        out.write(f"  {p.code:<21} {_safe(_rel(p.file, root))}: {_safe(p.message)}\n")
    if len(report.problems) > MAX_LINES:
        out.write(f"  … and {len(report.problems) - MAX_LINES} more (--json lists all)\n")
        counts = Counter(p.code for p in report.problems)
        out.write("problems by code: " + ", ".join(f"{c} × {n}" for c, n in counts.most_common()) + "\n")
    if report.unchecked:
        out.write(f"unchecked ({len(report.unchecked)}):\n")
        for f in report.unchecked[:20]:
            out.write(f"  {_safe(_rel(f, root))}\n")
        if len(report.unchecked) > 20:
            out.write(f"  … and {len(report.unchecked) - 20} more\n")
    for note in report.notes:
        out.write(f"note: {_safe(note)}\n")
    if report.problems:
        n = len(report.problems)
        out.write(f"FAILED: {n} problem{'s' if n != 1 else ''}\n")
    elif report.files == 0:
        out.write("NOTHING CHECKED\n")
    else:
        out.write("OK" + (" (some files unchecked, see above)" if report.unchecked else "") + "\n")


def run(argv: list[str]) -> int:
    """Entry point of `eaglewatch-agent check`; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        layers = parse_layers(args.layers) if args.layers is not None else None
        if args.hidden_size is not None and args.hidden_size <= 0:
            raise ValueError(f"--hidden-size {args.hidden_size}: must be a positive integer")
    except (_UsageError, ValueError) as e:
        sys.stderr.write(f"{parser.format_usage()}eaglewatch-agent check: error: {e}\n")
        return EXIT_CANNOT_RUN
    except SystemExit as e:  # --help
        return int(e.code or 0)
    root = Path(args.path)
    if not root.exists():
        sys.stderr.write(f"eaglewatch-agent check: error: no such file or directory: {_safe(args.path)}\n")
        return EXIT_CANNOT_RUN
    expect = expectation({"hidden_size": args.hidden_size, "model": args.model, "layer_ids": layers})
    if args.model is not None and expect.hidden_size is None:
        sys.stderr.write(
            f"eaglewatch-agent check: error: no hidden size in {_safe(args.model)}/config.json\n"
        )
        return EXIT_CANNOT_RUN
    report = check_path(root, expect, deep=not args.shallow)
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict()) + "\n")
    else:
        render(report, root, sys.stdout)
    if report.problems:
        return EXIT_PROBLEMS
    if report.files == 0:
        why = "; ".join(report.notes) or "no capture files"
        sys.stderr.write(f"eaglewatch-agent check: nothing was checked: {_safe(why)}\n")
        return EXIT_CANNOT_RUN
    return EXIT_OK


def main() -> None:
    """`python -m agent.checks.cli`."""
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
