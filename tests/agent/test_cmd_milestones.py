"""``eaglewatch-agent milestones``: a real subprocess over real log files, offline, no daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.vllm_log import make_log

ROOT = Path(__file__).resolve().parents[2]


def milestones(*args: str | Path, entry: str = "agent.milestones.cli") -> subprocess.CompletedProcess[str]:
    """Run it in a subprocess: ``python -m agent.milestones.cli …`` or ``python -m agent milestones …``."""
    argv = [sys.executable, "-m", *entry.split(), *map(str, args)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def oom_log(tmp_path: Path) -> Path:
    """A TP=8 run that dies of CUDA OOM, with colour codes and a tqdm bar."""
    path = tmp_path / "output.log"
    path.write_bytes(make_log(tp=8, failure="oom", colours=True))
    return path


@pytest.mark.parametrize("entry", ["agent.milestones.cli", "agent milestones"])
def test_json_output(oom_log: Path, entry: str) -> None:
    """--json: one object a line with exactly kind, line, rank, fields, text; per-rank lines once."""
    res = milestones(oom_log, "--json", entry=entry)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert rows, "no milestones"
    for row in rows:
        assert set(row) == {"kind", "line", "rank", "fields", "text"}
        assert isinstance(row["line"], int) and row["line"] >= 1
        assert "\x1b" not in row["text"]
    assert [r["line"] for r in rows] == sorted(r["line"] for r in rows)
    injected = [r for r in rows if r["kind"] == "extension_injected"]
    assert len(injected) == 1
    assert injected[0]["fields"]["ranks"] == list(range(8))
    assert injected[0]["rank"] is None
    (oom,) = [r for r in rows if r["kind"] == "error" and r["fields"]["class"] == "oom"]
    assert oom["fields"]["exc_type"] == "torch.OutOfMemoryError"
    assert oom["fields"]["ranks"] == list(range(8))


def test_table_output(oom_log: Path) -> None:
    """Without --json: a human table with a header, error classes and a count."""
    res = milestones(oom_log)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:4] == ["LINE", "KIND", "RANK", "RULE"]
    assert any("error:oom" in ln and "8 ranks" in ln for ln in lines)
    assert lines[-1].endswith("milestone(s)")
    assert int(lines[-1].split()[0]) == len(lines) - 2


def test_extra_rules_file(tmp_path: Path, oom_log: Path) -> None:
    """--rules adds a user's rule for this invocation."""
    rules = tmp_path / "mine.toml"
    rules.write_text(
        '[[rule]]\nname = "pynccl"\nkind = "warning"\ncontains = "nccl=="\n'
        "regex = 'nccl==(?P<v>\\S+)'\nper_rank = true\n"
    )
    (tmp_path / "small.log").write_bytes(b"(Worker_TP0 pid=1) INFO 02-21 22:48:03 [x.py:1] plain nccl==2.1\n")
    res = milestones(tmp_path / "small.log", "--rules", rules, "--json")
    assert res.returncode == 0, res.stderr
    (row,) = [json.loads(x) for x in res.stdout.splitlines()]
    assert (row["kind"], row["fields"]["v"], row["fields"]["ranks"]) == ("warning", "2.1", [0])


def test_missing_file_exits_2(tmp_path: Path) -> None:
    """No such log: exit 2, a one-line message naming the path, nothing on stdout."""
    res = milestones(tmp_path / "nope.log", "--json")
    assert res.returncode == 2
    assert res.stdout == ""
    assert "nope.log: no such file" in res.stderr


def test_directory_exits_2(tmp_path: Path) -> None:
    """A directory is not a log file."""
    res = milestones(tmp_path)
    assert res.returncode == 2
    assert "is a directory" in res.stderr


def test_bad_rules_file_exits_2(tmp_path: Path, oom_log: Path) -> None:
    """A broken rules file: exit 2, the message names file, rule index and field."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nname = "x"\nkind = "progress"\nregex = "(oops"\n')
    res = milestones(oom_log, "--rules", bad)
    assert res.returncode == 2
    assert res.stdout == ""
    assert f"{bad}: rule[0] 'x': field 'regex': does not compile" in res.stderr


def test_binary_garbage_and_huge_line(tmp_path: Path) -> None:
    """Invalid UTF-8 and a 10 MB line do not stop the scan; later milestones are still found."""
    log = tmp_path / "odd.log"
    log.write_bytes(b"\xff\xfe\x00garbage\n" + b"z" * (10 * 1024 * 1024) + b"\nKilled\n")
    res = milestones(log, "--json")
    assert res.returncode == 0, res.stderr
    (row,) = [json.loads(x) for x in res.stdout.splitlines()]
    assert (row["kind"], row["line"], row["fields"]["class"]) == ("error", 3, "killed")


@pytest.mark.parametrize(("failure", "code"), [(None, 0), ("nccl", 1)])
def test_generator_program_to_milestones(tmp_path: Path, failure: str | None, code: int) -> None:
    """The log generator run as a job (its stdout to a file), then the milestones of that file."""
    log = tmp_path / "output.log"
    extra = ["--failure", failure] if failure else []
    with log.open("wb") as out:
        job = subprocess.run(
            [sys.executable, "tests/helpers/vllm_log.py", "--tp", "2", *extra],
            cwd=ROOT, stdout=out, timeout=60, check=False,
        )  # fmt: skip
    assert job.returncode == code
    assert log.read_bytes() == make_log(tp=2, failure=failure)
    res = milestones(log, "--json", "--tp", "2")
    assert res.returncode == 0, res.stderr
    kinds = [json.loads(x)["kind"] for x in res.stdout.splitlines()]
    if failure:
        classes = [json.loads(x)["fields"].get("class") for x in res.stdout.splitlines()]
        assert "nccl" in classes and "completed" not in kinds
    else:
        assert kinds[-1] == "completed" and "error" not in kinds


@pytest.mark.parametrize(
    ("log", "want"),
    [
        (
            "vllm-0.26.0-h200-tp2-worker-extension.log",
            {"extension_injected", "weights_loaded", "kv_cache_ready", "engine_ready"},
        ),
        (
            "vllm-0.26.0-h200-tp2-native-graphs.log",
            {"weights_loaded", "kv_cache_ready", "cuda_graphs_captured", "engine_ready"},
        ),
    ],
)
def test_real_h200_tp2_logs(log: str, want: set[str]) -> None:
    """Recorded on the H200 with vLLM 0.26.0 (tests/gpu/validation.md): TP=2, the injection unprefixed."""
    res = milestones(ROOT / "tests" / "fixtures" / log, "--tp", "2", "--json")
    assert res.returncode == 0, res.stderr
    found = [json.loads(x) for x in res.stdout.splitlines()]
    assert want <= {m["kind"] for m in found}
    assert not [m for m in found if m["kind"] == "error"]
    injected = [m for m in found if m["kind"] == "extension_injected"]
    assert len(injected) == int("extension_injected" in want)
    for m in injected:
        assert m["fields"]["ranks"] == [0, 1] and m["fields"]["processes"] == 2


def test_deeply_nested_and_non_finite_markers_do_not_crash_it(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_text(
        'EAGLEWATCH {"kind": "progress", "x": ' + "[" * 5000 + "\n"
        'EAGLEWATCH {"kind": "throughput", "tok_s": NaN}\n'
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    res = milestones(log, "--json")
    assert res.returncode == 0, res.stderr
    got = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}"))
        for line in res.stdout.splitlines()
    ]
    assert got[0]["fields"]["rule"] == "bad_marker" and "deeper" in got[0]["fields"]["problem"]
    assert got[1]["kind"] == "throughput" and got[1]["fields"] == {"tok_s": None}
    assert len(got) == 3
