"""Table tests of the pure final-state decision (agent/runs/summary.py)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.runs.summary import RunSummary, final_state


def _err(cls: str, text: str = "boom") -> dict[str, Any]:
    return {"type": "milestone", "kind": "error", "fields": {"class": cls}, "text": text}


COMPLETED = {"type": "milestone", "kind": "completed", "fields": {}, "text": "done"}
EXIT0 = {"code": 0, "signal": None, "ended_at": 10.0}

CASES = [
    # (exit record, stop record, journal events, backend) -> (state, words in the reason)
    (EXIT0, None, [], "command", "completed", ["exit code 0"]),
    (EXIT0, None, [COMPLETED], "worker-extension", "completed", []),
    (EXIT0, None, [], "worker-extension", "failed", ["without a completion marker"]),
    (
        EXIT0,
        None,
        [_err("nccl", "NCCL error: unhandled system error")],
        "command",
        "failed",
        ["nccl", "NCCL error"],
    ),
    (EXIT0, None, [COMPLETED, _err("oom")], "vllm-native", "failed", ["oom"]),
    (EXIT0, None, [_err("import", "No module named x")], "command", "completed", []),  # not fatal by itself
    (
        {"code": 3, "signal": None},
        None,
        [_err("oom", "CUDA out of memory")],
        "command",
        "failed",
        ["exit code 3", "oom", "CUDA out of memory"],
    ),
    ({"code": None, "signal": 9, "signal_name": "SIGKILL"}, None, [], "command", "failed", ["SIGKILL"]),
    (
        {"code": 127, "signal": None, "error": "cannot start /nope: No such file"},
        None,
        [],
        "command",
        "failed",
        ["could not start", "/nope"],
    ),
    (
        {"code": None, "signal": 15, "ended_at": 12.0},
        {"by": "client", "requested_at": 11.0},
        [],
        "command",
        "stopped",
        ["stopped by request"],
    ),
    (
        {"code": None, "signal": 15, "ended_at": 12.0},
        {
            "by": "agent",
            "requested_at": 11.0,
            "reason": "shape check failed: hidden_dim_lost in hs_0.safetensors",
        },
        [],
        "command",
        "failed",
        ["hidden_dim_lost", "hs_0.safetensors"],
    ),
    # The job had already finished on its own when the stop arrived: its own outcome stands.
    (EXIT0, {"by": "client", "requested_at": 20.0}, [], "command", "completed", []),
    (None, None, [], "command", "lost", ["no exit status"]),
    (
        {"code": 2, "signal": None},
        None,
        [{"type": "milestone", "kind": "failed", "fields": {"reason": "model path /m does not exist"}}],
        "worker-extension",
        "failed",
        ["exit code 2; job reported: model path /m does not exist"],
    ),
    # The specific error is the root cause even when a generic "worker failed" line came first.
    (
        {"code": 1, "signal": None},
        None,
        [
            _err("engine_failed", "WorkerProc failed to start."),
            _err("oom", "CUDA out of memory"),
            _err("engine_failed", "Engine core initialization failed."),
        ],
        "command",
        "failed",
        ["error: oom: CUDA out of memory", "last error: engine_failed"],
    ),
]


@pytest.mark.parametrize(("exit_rec", "stop_rec", "events", "backend", "state", "words"), CASES)
def test_final_state(
    exit_rec: dict[str, Any] | None,
    stop_rec: dict[str, Any] | None,
    events: list[dict[str, Any]],
    backend: str,
    state: str,
    words: list[str],
) -> None:
    got_state, reason = final_state(exit_rec, stop_rec, RunSummary.from_events(events), backend)
    assert got_state == state
    for word in words:
        assert word in reason


def test_summary_keeps_first_terminal_state() -> None:
    s = RunSummary.from_events(
        [
            {"type": "state", "state": "running"},
            {"type": "state", "state": "failed", "reason": "exit code 1"},
            {"type": "state", "state": "completed"},
        ]
    )
    assert (s.terminal, s.reason) == ("failed", "exit code 1")
