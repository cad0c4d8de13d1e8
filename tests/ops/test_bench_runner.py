"""tests/bench/run_all.py: BENCH lines are read, goals judged, failing benchmarks shown; real subprocesses."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

RUN_ALL = Path(__file__).resolve().parents[1] / "bench" / "run_all.py"


def load() -> ModuleType:
    """Import tests/bench/run_all.py (tests/bench is not a package)."""
    spec = importlib.util.spec_from_file_location("run_all", RUN_ALL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


run_all = load()


@pytest.mark.parametrize(
    ("value", "goal", "expected"),
    [
        (250_000, ">= 200000", True),
        (150_000, ">= 200_000", False),
        (4.9, "<= 5", True),
        (5.1, "< 5", False),
        (1, None, None),
        (1, "about 5", None),
        (1, "~= 5", None),
        (float("nan"), "<= 5", None),
    ],
)
def test_meets_goal(value: float, goal: str | None, expected: bool | None) -> None:
    assert run_all.meets_goal(value, goal) is expected


def test_parse_records_fills_ok_and_reports_bad_lines() -> None:
    out = "\n".join(
        [
            "warming up",
            'BENCH {"name": "ingest", "metric": "rate", "value": 250000, "unit": "l/s", "goal": ">= 200000"}',
            'BENCH {"name": "rss", "metric": "rss", "value": 40, "unit": "MB", "goal": "<= 30", "ok": false}',
            "BENCH {not json",
            'BENCH {"name": "x"}',
        ]
    )
    records, bad = run_all.parse_records(out)
    assert [(r["name"], r["ok"]) for r in records] == [("ingest", True), ("rss", False)]
    assert bad == ["BENCH {not json", 'BENCH {"name": "x"}']


def test_bench_line_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_all.bench_line("check", "time per file", 1.5, "ms", goal="<= 5", baseline=3.0)
    assert capsys.readouterr().out == line + "\n"
    [record], bad = run_all.parse_records(line)
    assert bad == [] and record["ok"] is True and record["baseline"] == 3.0


def write(folder: Path, name: str, body: str) -> None:
    """Write one benchmark file."""
    (folder / name).write_text(body)


def test_main_runs_every_bench_and_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        tmp_path,
        "bench_fast.py",
        "from run_all import bench_line\nprint('measuring')\n"
        "bench_line('fast', 'rate', 1234567.0, 'lines/s', goal='>= 200000')\n"
        "bench_line('fast', 'rss', 41.0, 'MB', goal='<= 30')\n",
    )
    write(tmp_path, "bench_crash.py", "raise SystemExit('cannot set up')\n")
    write(tmp_path, "bench_silent.py", "print('no figures')\n")
    write(tmp_path, "helper.py", "raise AssertionError('not a bench: must not run')\n")
    code = run_all.main(["--dir", str(tmp_path), "--json", str(tmp_path / "all.json")])
    out = capsys.readouterr().out
    assert code == 1  # bench_crash exited 1, bench_silent printed no figure
    assert "=== bench_fast.py" in out and "measuring" in out and "cannot set up" in out
    summary = out[out.rindex("bench ") :]
    assert "1,234,567 lines/s" in summary and ">= 200000" in summary
    rows = {line.split()[0] + " " + line.split()[1]: line for line in summary.splitlines()[2:]}
    assert rows["fast rate"].endswith("yes") and rows["fast rss"].endswith("NO")
    assert "exit 1" in rows["bench_crash.py (run)"] and "no BENCH lines" in rows["bench_silent.py (run)"]
    assert "not a bench" not in out
    assert (tmp_path / "all.json").read_text().count('"metric"') == 2


def test_main_only_and_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        tmp_path,
        "bench_slowrss.py",
        "from run_all import bench_line\nbench_line('s', 'rss', 41, 'MB', '<= 30')\n",
    )
    write(tmp_path, "bench_crash.py", "raise SystemExit(3)\n")
    assert run_all.main(["--dir", str(tmp_path), "--only", "slowrss"]) == 0
    assert run_all.main(["--dir", str(tmp_path), "--only", "bench_slowrss.py", "--strict"]) == 1
    assert "bench_crash" not in capsys.readouterr().out


def test_main_kills_a_bench_at_its_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "bench_hang.py", "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    assert run_all.main(["--dir", str(tmp_path), "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "started" in out and "timed out" in out


def test_a_bench_that_cannot_run_here_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "bench_gpu.py", "import sys\nprint('no GPU here')\nsys.exit(77)\n")
    write(
        tmp_path,
        "bench_ok.py",
        "from run_all import bench_line\nbench_line('ok', 'rate', 5, 'x/s', '>= 1')\n",
    )
    assert run_all.main(["--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped: cannot run here" in out and "no GPU here" in out
