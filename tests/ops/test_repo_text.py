"""The shipped text stands on its own: no pointer to documents outside the repository, no development-history
labels or development-machine paths in any file git knows, and a README short enough to read."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 400

# Written with character classes so that this file does not match itself.
FORBIDDEN = {
    "a document outside the repository": re.compile(r"shared[/]|DESIGN[.]md"),
    "a development-history label": re.compile(
        r"\bsessions? [0-9]+|\bissue [0-9]+|\bv0[.][0-9] review", re.IGNORECASE
    ),
    "a development-machine path": re.compile(r"/work[/]|/root[/]|/home[/][a-z]", re.IGNORECASE),
}


def repo_files() -> list[Path]:
    """Files git tracks or would track (untracked but not ignored) that exist in the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    names = {n for n in listed.stdout.decode().split("\0") if n}
    return [ROOT / n for n in sorted(names) if (ROOT / n).is_file()]


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it is, the matched text) for every forbidden pattern in ``text``."""
    return [
        (number, what, found.group(0))
        for number, line in enumerate(text.splitlines(), start=1)
        for what, pattern in FORBIDDEN.items()
        for found in [pattern.search(line)]
        if found
    ]


@pytest.mark.parametrize(
    ("line", "bad"),
    [
        # Each example is split in two so that this file does not match the patterns itself.
        ("see shared" + "/domain/vllm.md", True),
        ("the contract of DESIGN" + ".md", True),
        ("measured in session" + " 6", True),
        ("sessions" + " 3-5 found it", True),
        ("fixed for issue" + " 16", True),
        ("the v0.2" + " review said so", True),
        ("File /work" + "/main/.venv/lib/x.py", True),
        ("/root" + "/.cache/vllm", True),
        ("/home" + "/alice/models", True),
        ("MaxStartups 200\\nMaxSessions" + " 200", False),
        ("a session cookie expires after session_ttl_s", False),
        ("vLLM #48124, fixed by #46973", False),
        ("/srv/models/llama and /data/sharegpt.jsonl", False),
    ],
)
def test_the_patterns_catch_what_they_mean(line: str, bad: bool) -> None:
    assert bool(hits(line)) is bad


def test_no_file_points_outside_the_repo_or_at_development_history() -> None:
    found = []
    for path in repo_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: no prose in it
        found += [f"{path.relative_to(ROOT)}:{n}: {what}: {m!r}" for n, what, m in hits(text)]
    assert found == []


def test_the_readme_is_at_most_400_lines() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"
