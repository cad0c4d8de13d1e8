"""Packaging: the wheel carries templates, static files and rule data; `[agent]` installs nothing else.

The wheel is built offline from a copy of the source (setuptools from this venv, no build isolation) and
installed with `--no-index` into a fresh, empty venv: a dependency that crept into the agent would make the
install fail here instead of downloading it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

import agent

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "controller", "web", "cli")
DATA_DIRS = ("web/templates", "web/static", "agent/milestones/rules")

pytestmark = pytest.mark.slow


def run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run argv, failing the test with its output when it exits non-zero."""
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, (
        f"{argv} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the project's wheel from a clean copy of the source tree."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    dist = src / "dist"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ".",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
        ],
        cwd=src,
    )
    [built] = dist.glob("eaglewatch-*.whl")
    return built


@pytest.fixture(scope="module")
def agent_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A fresh venv (no pip, nothing installed) with `eaglewatch[agent]` installed from the wheel alone."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    report = venv / "report.json"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheel.parent),
            "--report",
            str(report),
            "eaglewatch[agent]",
        ]
    )
    return venv, json.loads(report.read_text())


def test_wheel_contains_every_template_static_file_and_rule_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in DATA_DIRS:
        files = [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        assert files, f"{folder} is empty in the source tree"
        missing = sorted(str(p.relative_to(ROOT)) for p in files if str(p.relative_to(ROOT)) not in names)
        assert not missing, f"left out of the wheel: {missing}"
    assert any(n.startswith("agent/milestones/rules/") and n.endswith(".toml") for n in names)
    assert any(n.startswith("web/templates/") for n in names)


def test_wheel_declares_both_console_scripts(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        [entry] = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(entry).decode()
    assert "eaglewatch = cli.app:main" in text
    assert "eaglewatch-agent = agent.cli:main" in text


def test_agent_extra_installs_nothing_but_eaglewatch(agent_venv: tuple[Path, dict[str, Any]]) -> None:
    _, report = agent_venv
    installed = [item["metadata"]["name"] for item in report["install"]]
    assert installed == ["eaglewatch"]


def test_agent_core_imports_with_the_standard_library_only(
    agent_venv: tuple[Path, dict[str, Any]],
) -> None:
    """Every agent module (subpackages too) but spec.py and extract/ imports with the stdlib alone."""
    venv, _ = agent_venv
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "agent").rglob("*.py")
        if p.name != "__main__.py" and p.relative_to(ROOT).parts[1] not in ("spec.py", "extract")
    )
    expected = {"agent.jobs.gpus", "agent.protocol", "agent.daemon.server", "agent.checks.checker"}
    assert expected <= set(modules)
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    result = run([str(venv / "bin" / "python"), "-I", "-c", code, *modules])
    assert result.stdout.strip() == "ok"


@pytest.fixture(scope="module")
def controller_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel (no deps resolved) that borrows this venv's third-party packages.

    The borrowed site-packages comes in through a .pth line, which adds the folder to sys.path without
    running the .pth files inside it, so this project's editable install does not shadow the wheel.
    """
    venv = tmp_path_factory.mktemp("cvenv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-index",
         "--no-deps", str(wheel)])  # fmt: skip
    [site] = (venv / "lib").glob("python3*/site-packages")
    borrowed = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "zz-borrowed.pth").write_text("\n".join(borrowed) + "\n")
    return venv


def test_versions_agree(agent_venv: tuple[Path, dict[str, Any]], controller_venv: Path) -> None:
    venv, _ = agent_venv
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == agent.__version__
    out = run([str(venv / "bin" / "eaglewatch-agent"), "--version"]).stdout
    assert agent.__version__ in out.split()
    meta = run([str(venv / "bin" / "python"), "-I", "-c",
                "import importlib.metadata as m; print(m.version('eaglewatch'))"]).stdout.strip()  # fmt: skip
    assert meta == agent.__version__
    controller = run([str(controller_venv / "bin" / "eaglewatch"), "--version"]).stdout
    assert agent.__version__ in controller.split()
    where = run(
        [str(controller_venv / "bin" / "python"), "-I", "-c", "import controller; print(controller.__file__)"]
    )
    assert str(controller_venv) in where.stdout  # the wheel's code ran, not a checkout's
