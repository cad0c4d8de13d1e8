"""The terminal's view of a run: marker lines in words, one line per batch (pure, and ``runs logs``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cli.demo import Echo
from cli.terminal import TerminalView
from tests.cli.test_commands import cli

pytestmark = pytest.mark.timeout(120)


def marker(kind: str, **fields: object) -> str:
    """A marker line as the extraction job prints it."""
    return "EAGLEWATCH " + json.dumps({"kind": kind, **fields}, separators=(", ", ": "))


#: Two batches of the extraction job, as its log holds them (one failed check in the second).
JOB_LOG = [
    "[eaglewatch] capturing layers [2, 4, 6, 8] (input convention) of LlamaDecoderLayer",
    marker("shape_check_passed", file="hs_0.safetensors", index=0),
    marker("shape_check_passed", file="hs_1.safetensors", index=1),
    marker("batch_captured", batch=1, samples=2, tokens=812),
    marker("progress", samples_done=2, samples_total=4, tokens_per_s=830.5, files_written=2, bytes_written=9),
    "[eaglewatch] 2/4 samples, 830.5 tok/s, 2 files, 9 bytes",
    marker("shape_check_passed", file="hs_2.safetensors", index=2),
    marker("shape_check_failed", file="hs_3.safetensors", index=3, code="all_zero", message="all zero"),
    marker("batch_captured", batch=2, samples=2, tokens=400),
    marker(
        "progress", samples_done=4, samples_total=4, tokens_per_s=900.0, files_written=4, bytes_written=18
    ),
    "[eaglewatch] 4/4 samples, 900.0 tok/s, 4 files, 18 bytes",
    marker("completed", samples=4, files=4, tokens=1212, seconds=3.25),
]


def test_markers_become_words_one_line_per_batch() -> None:
    view = TerminalView()
    shown = [text for line in JOB_LOG for text, _ in view.line(line)] + [t for t, _ in view.flush()]
    assert shown == [
        "[eaglewatch] capturing layers [2, 4, 6, 8] (input convention) of LlamaDecoderLayer",
        "batch 1 captured: 2 files, 812 tokens, 2 passed shape checks; 2/4 samples, 830.5 tokens/s",
        "shape check FAILED: hs_3.safetensors: all zero",
        "batch 2 captured: 2 files, 400 tokens, 1 passed shape check; 4/4 samples, 900.0 tokens/s",
        "completed: 4 samples, 4 files, 1,212 tokens in 3.2 s",
    ]


def test_a_batch_line_is_not_held_back_when_no_progress_follows() -> None:
    view = TerminalView()
    assert view.line(marker("batch_captured", batch=7, samples=3, tokens=30)) == []
    assert view.flush() == [("batch 7 captured: 3 files, 30 tokens", "batch_captured")]
    assert view.line("(EngineCore pid=1) " + marker("failed", reason="boom")) == [("failed: boom", "failed")]
    assert view.line("plain text") == [("plain text", None)]


def test_runs_logs_in_words_and_raw(tmp_path: Path, reap: None) -> None:
    add = cli(tmp_path, "hosts", "add", "loc", "--ssh", "local", "--state-dir", str(tmp_path / "agent"))
    assert add.returncode == 0, add.stderr
    script = tmp_path / "job.py"
    script.write_text("\n".join(f"print({line!r}, flush=True)" for line in JOB_LOG) + "\n")
    start = cli(tmp_path, "runs", "start", "--host", "loc", "--json", "--", sys.executable, str(script))
    run_id = json.loads(start.stdout)["id"]
    deadline = time.monotonic() + 60
    while json.loads(cli(tmp_path, "runs", "show", run_id, "--json").stdout)["state"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    logs = cli(tmp_path, "runs", "logs", run_id)
    assert logs.returncode == 0, logs.stderr
    assert "EAGLEWATCH" not in logs.stdout and '{"' not in logs.stdout
    assert "shape check passed" not in logs.stdout and "2/4 samples, 830.5 tok/s" not in logs.stdout
    assert "batch 1 captured: 2 files, 812 tokens, 2 passed shape checks; 2/4 samples" in logs.stdout
    assert len([ln for ln in logs.stdout.splitlines() if " captured: " in ln]) == 2
    raw = cli(tmp_path, "runs", "logs", run_id, "--raw")
    assert raw.stdout.splitlines() == JOB_LOG


def test_the_demo_echo_names_each_problem_once_and_the_verdict_once() -> None:
    """The broken demo run's events as the bus brings them: live checks, the end, then the late checks."""
    echo = Echo()

    def failed(i: int) -> dict[str, Any]:
        fields = {"file": f"hs_{i}.safetensors", "code": "layer_count_mismatch", "message": "3 layers, not 4"}
        return {"kind": "shape_check_failed", "fields": fields, "text": "layer_count_mismatch: …"}

    batch = {"kind": "batch_captured", "fields": {"batch": 1, "samples": 2, "tokens": 64},
             "text": 'EAGLEWATCH {"kind": "batch_captured"}'}  # fmt: skip
    vllm = "(EngineCore_DP0 pid=7) WARNING 12-02 11:00:00 [cpu.py:9] " + "long words " * 30
    ended = {"state": "completed", "verdict_text": "completed — 4 of 4 files failed shape checks"}
    events = [("milestone", batch), ("milestone", failed(0)), ("milestone", failed(1)),
              ("milestone", {"kind": "warning", "fields": {}, "text": vllm}), ("run", ended),
              ("milestone", failed(2)), ("milestone", failed(3)), ("run", ended)]  # fmt: skip
    lines = [line for kind, data in events for line in echo.event(kind, "r1", data)]
    assert lines[0] == "  run r1: problem layer_count_mismatch: 3 layers, not 4 (first in hs_0.safetensors)"
    assert lines[1] == "  run r1: batch 1 captured: 2 files, 64 tokens"
    assert lines[2].startswith("  run r1: warning: long words") and lines[2].endswith(" …")
    assert "pid=7" not in lines[2] and len(lines[2]) < 160
    assert lines[3:] == ["  run r1: verdict: completed — 4 of 4 files failed shape checks"]
