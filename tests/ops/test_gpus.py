"""GPU discovery: nvidia-smi CSV parsing (tables + outputs recorded on a real H200) and query()'s I/O."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest

from agent.jobs import gpus

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nvidia-smi"
H200_UUID = "GPU-eb00ebd1-8708-a4aa-5053-122bb6d20cec"


def fixture(name: str) -> str:
    """Text of one nvidia-smi output recorded on the lent H200 (tests/ops/h200/capture.sh)."""
    return (FIXTURES / name).read_text()


# --- pure parsers: real outputs -------------------------------------------------------------------------


def test_real_h200_idle_gpu_csv() -> None:
    rows, errors = gpus.parse_gpu_csv(fixture("query-gpu-idle.csv"))
    assert errors == []
    assert rows == [
        {
            "index": 0,
            "uuid": H200_UUID,
            "name": "NVIDIA H200",
            "memory_total_mib": 143771,
            "memory_used_mib": 0,
            "utilization_pct": 0,
            "temperature_c": 38,
        }
    ]


def test_real_h200_busy_gpu_and_process_csv() -> None:
    gpu_rows, _ = gpus.parse_gpu_csv(fixture("query-gpu-busy.csv"))
    app_rows, app_errors = gpus.parse_process_csv(fixture("query-apps-busy.csv"))
    assert gpu_rows[0]["memory_used_mib"] == 21007
    assert app_errors == []
    assert app_rows == [{"pid": 420, "gpu_uuid": H200_UUID, "used_memory_mib": 20998}]


def test_real_h200_idle_process_csv_is_empty() -> None:
    assert fixture("query-apps-idle.csv") == ""
    assert gpus.parse_process_csv(fixture("query-apps-idle.csv")) == ([], [])


def test_header_and_units_are_understood() -> None:
    """`--format=csv` (header line, units on numbers) parses to the same row as the noheader,nounits form."""
    with_units = gpus.parse_gpu_csv(fixture("query-gpu-header-units.csv"))
    plain = gpus.parse_gpu_csv(fixture("query-gpu-idle.csv"))
    assert with_units[1] == []
    assert with_units[0] == plain[0]


# --- pure parsers: tables of odd lines ------------------------------------------------------------------

GPU_LINES = [
    # (line, expected row subset or None when the line must be reported)
    (
        "3, GPU-aa, NVIDIA A100-SXM4-80GB, [N/A], [N/A], [Not Supported], [N/A]",
        {
            "index": 3,
            "memory_total_mib": None,
            "memory_used_mib": None,
            "utilization_pct": None,
            "temperature_c": None,
        },
    ),
    (
        "1, MIG-bb, NVIDIA H100 80GB HBM3 MIG 1g.10gb, 9984, 13, N/A, 41",
        {"uuid": "MIG-bb", "utilization_pct": None, "temperature_c": 41},
    ),
    ("2, GPU-cc, Tesla T4, Inc, 15360, 3, 7, 50", {"name": "Tesla T4, Inc", "memory_total_mib": 15360}),
    ("0, GPU-dd, NVIDIA H200, 143771.0, 12.0, 99, 80", {"memory_total_mib": 143771, "utilization_pct": 99}),
    ("0, GPU-ee, NVIDIA H200, 143771, 0, 0", None),  # a field short
    ("x, GPU-ee, NVIDIA H200, 143771, 0, 0, 30", None),  # index not a number
    ("[N/A], GPU-ee, NVIDIA H200, 143771, 0, 0, 30", None),  # index missing
    ("0, not-a-uuid, NVIDIA H200, 143771, 0, 0, 30", None),
    ("0, GPU-ee, NVIDIA H200, lots, 0, 0, 30", None),
    ("Unable to determine the device handle for GPU0000:00:06.0: Unknown Error", None),
]


@pytest.mark.parametrize(("line", "expected"), GPU_LINES)
def test_gpu_line_table(line: str, expected: dict[str, object] | None) -> None:
    rows, errors = gpus.parse_gpu_csv(f"{line}\n")
    if expected is None:
        assert rows == []
        [err] = errors
        assert (err["query"], err["line"], err["text"]) == ("gpu", 1, line)
        assert err["reason"]
    else:
        assert errors == []
        [row] = rows
        assert {k: row[k] for k in expected} == expected


PROCESS_LINES = [
    ("4242, GPU-aa, 20998", {"pid": 4242, "gpu_uuid": "GPU-aa", "used_memory_mib": 20998}),
    ("4243, GPU-aa, [N/A]", {"pid": 4243, "gpu_uuid": "GPU-aa", "used_memory_mib": None}),
    ("No running processes found", "skip"),
    ("[N/A], GPU-aa, 10", None),
    ("4242, GPU-aa", None),
    ("4242, GPU-aa, 10, extra", None),
    ("pid?, GPU-aa, 10", None),
]


@pytest.mark.parametrize(("line", "expected"), PROCESS_LINES)
def test_process_line_table(line: str, expected: dict[str, object] | str | None) -> None:
    rows, errors = gpus.parse_process_csv(line + "\n")
    if expected == "skip":
        assert (rows, errors) == ([], [])
    elif expected is None:
        assert rows == []
        assert [(e["query"], e["line"]) for e in errors] == [("process", 1)]
    else:
        assert rows == [expected] and errors == []


def test_bad_line_is_skipped_and_the_rest_kept() -> None:
    text = (
        fixture("query-gpu-idle.csv")
        + "garbage line\n"
        + fixture("query-gpu-idle.csv").replace("0,", "1,", 1)
    )
    rows, errors = gpus.parse_gpu_csv(text)
    assert [r["index"] for r in rows] == [0, 1]
    assert [(e["line"], e["text"]) for e in errors] == [(2, "garbage line")]
    assert errors[0]["reason"].startswith("expected 7")


# --- query(): the I/O edge ------------------------------------------------------------------------------
# These tests run a stand-in `nvidia-smi` script: this machine has no GPU. It replays the outputs recorded on
# the real H200 (or fails / hangs the way a broken driver makes nvidia-smi do).


def make_smi(tmp_path: Path, body: str) -> Path:
    """Write an executable stand-in nvidia-smi (a shell script) and return its path."""
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_query_without_nvidia_smi_is_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("EAGLEWATCH_NVIDIA_SMI", raising=False)
    assert gpus.find_nvidia_smi() is None
    assert gpus.query() == {"gpus": [], "processes": []}


def test_query_replays_real_h200_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    body = (
        'case "$1" in\n'
        f"  --query-gpu=*) cat '{FIXTURES / 'query-gpu-busy.csv'}' ;;\n"
        f"  --query-compute-apps=*) cat '{FIXTURES / 'query-apps-busy.csv'}' ;;\n"
        "  *) exit 2 ;;\nesac\n"
    )
    monkeypatch.setenv("EAGLEWATCH_NVIDIA_SMI", str(make_smi(tmp_path, body)))
    result = gpus.query()
    assert set(result) == {"gpus", "processes"}
    assert result["gpus"][0]["name"] == "NVIDIA H200"
    assert result["processes"] == [{"pid": 420, "gpu_uuid": H200_UUID, "used_memory_mib": 20998}]


def test_query_reports_a_failing_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    msg = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    smi = make_smi(tmp_path, f'echo "{msg}"\nexit 9\n')
    result = gpus.query(nvidia_smi=str(smi))
    assert result["gpus"] == [] and result["processes"] == []
    [err] = result["errors"]
    assert err["query"] == "gpu" and "exited with 9" in err["reason"] and msg in err["reason"]


def test_query_reports_malformed_lines_and_keeps_good_ones(tmp_path: Path) -> None:
    smi = make_smi(tmp_path, "echo '0, GPU-aa, NVIDIA H200, 143771, 5, 1, 30'\necho 'half, a line'\n")
    result = gpus.query(nvidia_smi=str(smi))
    assert [g["uuid"] for g in result["gpus"]] == ["GPU-aa"]
    # The stand-in prints the same text for the process query: both lines are malformed there.
    assert result["processes"] == []
    assert [(e["query"], e["line"]) for e in result["errors"]] == [("gpu", 2), ("process", 1), ("process", 2)]


def test_query_times_out_and_kills_the_hung_query(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    smi = make_smi(tmp_path, f"sleep 30 &\necho $! > '{marker}'\nwait\n")
    started = time.monotonic()
    result = gpus.query(timeout_s=0.5, nvidia_smi=str(smi))
    assert time.monotonic() - started < 5
    assert "timed out after 0.5 s" in result["errors"][0]["reason"]
    # The stand-in's child (sleep) was killed with its group, not left behind.
    child = int(marker.read_text())
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.05)
    assert not alive(child)


def alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie awaiting its reaper counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_query_with_unexecutable_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EAGLEWATCH_NVIDIA_SMI", str(tmp_path / "missing"))
    assert gpus.query() == {"gpus": [], "processes": []}


@pytest.mark.skipif(sys.platform != "linux", reason="nvidia-smi only on Linux")
def test_query_on_this_machine_never_raises() -> None:
    """Whatever this machine has (usually no GPU), query() answers the protocol's shape."""
    result = gpus.query(timeout_s=10)
    assert isinstance(result["gpus"], list) and isinstance(result["processes"], list)
    assert set(result) <= {"gpus", "processes", "errors"}
