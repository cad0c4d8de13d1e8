"""Every ``eaglewatch`` command's ``--help``: each option says what it does, and a flag reads as a flag."""

from __future__ import annotations

from typing import Any

import typer.main
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

from cli.app import app


def commands(group: TyperGroup, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(words after ``eaglewatch``, command) of every command, groups first."""
    found: list[tuple[tuple[str, ...], Any]] = [(path, group)]
    for name, cmd in sorted(group.commands.items()):
        found += commands(cmd, (*path, name)) if isinstance(cmd, TyperGroup) else [((*path, name), cmd)]
    return found


def test_every_option_has_help_text_and_flags_take_no_value() -> None:
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    walked = commands(root)
    assert {("runs", "show"), ("runs", "start"), ("hosts", "add"), ("demo",)} <= {p for p, _ in walked}
    runner = CliRunner()
    for path, cmd in walked:
        shown = [p for p in cmd.params if isinstance(p, TyperOption) and not p.hidden]
        silent = [p.opts[0] for p in shown if not (p.help or "").strip()]
        assert silent == [], f"eaglewatch {' '.join(path)}: options without help: {silent}"
        res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        assert "<bool>" not in res.output, res.output
        for opt in shown:
            assert opt.opts[0] in res.output, (path, opt.opts[0])
