"""docs/architecture.md's module map is the tree; imports flow cli → web → controller → agent."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "controller", "web", "cli")


def documented() -> set[str]:
    """Paths the Layout block of docs/architecture.md names: folders end with '/', the rest are files."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^## Layout\n.*?```\n(.*?)```", text, re.S | re.M)
    assert block, "docs/architecture.md has no Layout block"
    stack: list[str] = []
    paths = set()
    for line in block.group(1).splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        del stack[depth:]
        paths.add("".join(stack) + name)
        if name.endswith("/"):
            stack.append(name)
    return paths


def test_the_layout_names_every_module_and_nothing_else() -> None:
    modules = {
        str(p.relative_to(ROOT))
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and "extract" not in p.relative_to(ROOT).parts  # one line in the map
    }
    named = {p for p in documented() if p.endswith(".py")}
    assert named == modules, {
        "not in the map": sorted(modules - named),
        "not in tree": sorted(named - modules),
    }
    for folder in (p for p in documented() if p.endswith("/")):
        assert (ROOT / folder).is_dir(), f"the map names {folder}, which does not exist"


def imports_of(path: Path) -> set[str]:
    """Top-level packages this file imports, at any depth of the file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_imports_flow_cli_web_controller_agent() -> None:
    # controller/ is the service only: the terminal (typer, rich) belongs to cli/, pages to web/
    forbidden = {
        "agent": {"controller", "web", "cli"},
        "controller": {"web", "cli", "typer", "rich"},
        "web": {"cli"},
    }
    wrong = [
        f"{p.relative_to(ROOT)} imports {bad}"
        for pkg, banned in forbidden.items()
        for p in (ROOT / pkg).rglob("*.py")
        for bad in imports_of(p) & banned
    ]
    assert wrong == []
