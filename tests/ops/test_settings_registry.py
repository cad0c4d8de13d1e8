"""The README's table of settings is both registries, row for row; no other module reads an EAGLEWATCH_ name.

`python -m tests.ops.test_settings_registry` prints the table the README should hold.
"""

from __future__ import annotations

import ast
import os
import re
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic.fields import FieldInfo

from agent import settings as agent_settings
from controller.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "controller", "web", "cli")
REGISTRIES = {ROOT / "agent" / "settings.py", ROOT / "controller" / "settings.py"}
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"
HEADER = "| variable | type | default | what it does |"
NAME = re.compile(r"EAGLEWATCH_[A-Z0-9_]*")
#: config.toml is found through the home, so the home itself can only come from the environment
ENV_ONLY = {"home"}


def _kind(annotation: Any) -> str:
    """A field's type as the table names it (an optional path is a path, any list a list)."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is list:
        return "list"
    names = {Path: "path", str: "str", int: "int", float: "float", bool: "bool"}
    return names[annotation]


def _shown(value: Any) -> str:
    """A default as the table shows it: paths under the home with '~', numbers without a trailing '.0'."""
    if value is None or value == []:
        return "unset"
    if isinstance(value, Path):
        home = str(Path.home())
        return "`" + ("~" + str(value)[len(home) :] if str(value).startswith(home) else str(value)) + "`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _controller_row(name: str, field: FieldInfo) -> tuple[str, str, str, str]:
    default = field.get_default(call_default_factory=True)
    where = "" if name in ENV_ONLY else f"; config.toml `{name}`"
    return (
        f"`EAGLEWATCH_{name.upper()}`",
        _kind(field.annotation),
        _shown(default),
        f"{field.description}{where}",
    )


def _agent_row(s: agent_settings.Setting[Any]) -> tuple[str, str, str, str]:
    if s.by_agent:
        return f"`{s.name}`", s.type, "set by the agent", s.doc
    return f"`{s.name}`", s.type, f"`{s.default}`" if s.default else "unset", s.doc


def expected() -> list[tuple[str, str, str, str]]:
    """One row per setting: the controller's fields, then the agent's table (EAGLEWATCH_HOME unset)."""
    rows = [_controller_row(name, field) for name, field in Settings.model_fields.items()]
    return rows + [_agent_row(s) for s in agent_settings.REGISTRY]


def table(rows: list[tuple[str, str, str, str]]) -> str:
    """The markdown table between the README's markers."""
    return "\n".join([HEADER, "|---|---|---|---|", *("| " + " | ".join(r) + " |" for r in rows)])


def documented() -> list[tuple[str, ...]]:
    """The rows of README.md's table of settings."""
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text, f"README.md has no {BEGIN} … {END} block"
    lines = text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    assert lines[:2] == [HEADER, "|---|---|---|---|"], lines[:2]
    return [tuple(cell.strip() for cell in line.strip().strip("|").split("|")) for line in lines[2:]]


def test_the_readme_table_is_both_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLEWATCH_HOME", raising=False)
    monkeypatch.delenv("EAGLEWATCH_DEMO_HOME", raising=False)
    want = {r[0]: r for r in expected()}
    got = {r[0]: r for r in documented()}
    assert len(got) == len(documented()), "a variable has two rows"
    problems = {
        "missing": sorted(set(want) - set(got)),
        "extra": sorted(set(got) - set(want)),
        "differs": sorted(k for k in set(want) & set(got) if want[k] != got[k]),
    }
    assert not any(problems.values()), f"{problems}; the table should read:\n{table(expected())}"


def test_every_setting_has_a_type_a_default_and_a_doc() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description and "|" not in field.description, name
        _kind(field.annotation)  # a type the table can name
        assert field.default is not None or field.default_factory is not None or "unset" in field.description
    module = {v.name for v in vars(agent_settings).values() if isinstance(v, agent_settings.Setting)}
    names = [s.name for s in agent_settings.REGISTRY]
    assert sorted(names) == sorted(module) and len(set(names)) == len(names)
    assert all(s.doc and "|" not in s.doc and NAME.fullmatch(s.name) for s in agent_settings.REGISTRY)


def test_only_the_registries_name_an_eaglewatch_variable() -> None:
    """A module reads (or sets) a variable through a registry; the name as a whole string is theirs alone."""
    found = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).is_dir() else ():
            if path in REGISTRIES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and NAME.fullmatch(node.value)
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert found == []


def test_a_malformed_agent_setting_names_variable_and_value() -> None:
    with pytest.raises(
        agent_settings.SettingError, match=r"EAGLEWATCH_SLURM_POLL_S='0.1': expected a number"
    ):
        agent_settings.SLURM_POLL_S.get({"EAGLEWATCH_SLURM_POLL_S": "0.1"})
    with pytest.raises(ValueError, match=r"EAGLEWATCH_ALLOW_UNTESTED_VLLM='maybe': expected 1 or 0"):
        agent_settings.ALLOW_UNTESTED_VLLM.get({"EAGLEWATCH_ALLOW_UNTESTED_VLLM": "maybe"})
    assert (
        agent_settings.SLURM_POLL_S.get({}) == 10.0
        and agent_settings.CAPTURE.get({"EAGLEWATCH_CAPTURE": "AUX"}) == "aux"
    )


def test_the_agent_reads_the_environment_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EAGLEWATCH_AGENT_HOME", str(tmp_path))
    assert agent_settings.AGENT_HOME.get() == tmp_path
    monkeypatch.delenv("EAGLEWATCH_AGENT_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert agent_settings.AGENT_HOME.get() == tmp_path / "h" / ".local" / "state" / "eaglewatch-agent"


if __name__ == "__main__":
    os.environ.pop("EAGLEWATCH_HOME", None)
    os.environ.pop("EAGLEWATCH_DEMO_HOME", None)
    print(table(expected()))
