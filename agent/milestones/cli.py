"""``eaglewatch-agent milestones LOGFILE [--rules FILE] [--json]``: the milestones of a log, offline."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import Milestone, MilestoneEngine, RuleError, RuleSet, load_rules

CHUNK = 1 << 20
PROG = "eaglewatch-agent milestones"


def scan(path: Path, rules: RuleSet, world_size: int | None = None) -> Iterator[Milestone]:
    """Yield the milestones of a log file in line order (the daemon's split + rules path, read once)."""
    splitter = LineSplitter()
    engine = MilestoneEngine(rules, world_size=world_size)
    n = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            for line in splitter.feed(chunk):
                n += 1
                yield from engine.feed(line.text, n)
    for line in splitter.flush():
        n += 1
        yield from engine.feed(line.text, n)
    yield from engine.flush()


def _summary(fields: dict[str, Any], width: int = 100) -> str:
    parts = []
    for key, value in fields.items():
        if key in ("rule", "severity"):
            continue
        shown = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
        if len(shown) > 40:
            shown = shown[:37] + "..."
        parts.append(f"{key}={shown}")
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 3] + "..."


def _print_table(milestones: Iterator[Milestone], out: TextIO) -> None:
    out.write(f"{'LINE':>7}  {'KIND':<21} {'RANK':<9} {'RULE':<26} FIELDS\n")
    count = 0
    for m in milestones:
        ranks = m.fields.get("ranks")
        rank = (f"{len(ranks)} ranks" if len(ranks) > 1 else str(ranks[0])) if ranks else m.rank
        kind = f"{m.kind}:{m.fields['class']}" if m.kind == "error" and "class" in m.fields else m.kind
        rule = str(m.fields.get("rule", "-"))
        fields = {k: v for k, v in m.fields.items() if k not in ("ranks", "class")}
        out.write(
            f"{m.line:>7}  {kind:<21} {'-' if rank is None else rank!s:<9} {rule:<26} {_summary(fields)}\n"
        )
        count += 1
    out.write(f"{count} milestone(s)\n")


def run(argv: list[str]) -> int:
    """Entry point; returns the exit status (0 ok, 2 cannot run: no such file, bad rules file)."""
    parser = argparse.ArgumentParser(prog=PROG, description="Print the milestones found in a finished log.")
    parser.add_argument("logfile", type=Path, help="the log file (e.g. runs/<id>/output.log)")
    parser.add_argument(
        "--rules", type=Path, action="append", default=[], metavar="FILE", help="extra rule file (TOML/JSON)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    parser.add_argument("--tp", type=int, help="tensor-parallel size (closes rank groups early)")
    args = parser.parse_args(argv)
    if not args.logfile.is_file():
        what = "is a directory" if args.logfile.is_dir() else "no such file"
        print(f"{PROG}: error: {args.logfile}: {what}", file=sys.stderr)
        return 2
    try:
        rules = load_rules(files=args.rules)
    except RuleError as exc:
        print(f"{PROG}: error: bad rules: {exc}", file=sys.stderr)
        return 2
    try:
        milestones = scan(args.logfile, rules, world_size=args.tp)
        if args.json:
            for m in milestones:
                sys.stdout.write(json.dumps(m.to_dict(), ensure_ascii=False) + "\n")
        else:
            _print_table(milestones, sys.stdout)
    except BrokenPipeError:  # `... | head`
        return 0
    except OSError as exc:
        print(f"{PROG}: error: {args.logfile}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
