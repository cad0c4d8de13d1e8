"""The daemon against hostile input: deep markers, non-finite numbers, malformed requests, slow rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers.agentjobs import OOM_TRACEBACK, VLLM_LINES, marker, printer
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon, terminal_event

__all__ = ["agent_daemon"]


def _cmd(argv: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": "t", "host": "local", "backend": "command", "command": argv, **extra}


def _events(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["event"] for m in msgs if m.get("type") == "event"]


def _refuse(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_deeply_nested_marker_does_not_hide_the_lines_after_it(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    lines = [
        VLLM_LINES[0],
        'EAGLEWATCH {"kind": "progress", "x": ' + "[" * 5000,
        *OOM_TRACEBACK,
        marker("shape_check_failed", file="hs_0.safetensors", problem="hidden_dim_lost"),
    ]
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="deep", spec=_cmd(printer(tmp_path, lines, exit_code=0)))
        c.result("follow", run="deep", after_seq=0)
        events = _events(c.wait_for(terminal_event))
    kinds = [e.get("kind") for e in events]
    bad = [e for e in events if e.get("kind") == "warning"]
    assert bad and bad[0]["fields"]["rule"] == "bad_marker" and "deeper" in bad[0]["fields"]["problem"]
    assert any(e.get("kind") == "error" and e["fields"]["class"] == "oom" for e in events), kinds
    assert "shape_check_failed" in kinds
    assert events[-1]["state"] == "failed"


def test_non_finite_marker_numbers_are_written_as_json_null(agent_daemon: AgentProc, tmp_path: Path) -> None:
    lines = [
        'EAGLEWATCH {"kind": "throughput", "tok_s": NaN, "peak": Infinity, "low": -Infinity, "big": 1e999}',
    ]
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="nan", spec=_cmd(printer(tmp_path, lines)))
        c.result("follow", run="nan", after_seq=0)
        events = _events(c.wait_for(terminal_event))
    journal = (agent_daemon.state_dir / "runs" / "nan" / "events.jsonl").read_text()
    for line in journal.splitlines():  # strict JSON: no bare constants, which Python's json alone accepts
        json.loads(line, parse_constant=_refuse)
    tp = [e for e in events if e.get("kind") == "throughput"]
    assert tp and tp[0]["fields"] == {"tok_s": None, "peak": None, "low": None, "big": None}


def test_malformed_requests_get_error_replies_and_the_connection_carries_on(agent_daemon: AgentProc) -> None:
    bad_lines = [
        b'{"id": ' + b"9" * 5000 + b', "op": "version"}\n',
        b"[" * 200_000 + b"\n",
        b'{"id": 1, "op": "version", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n",
        b'{"id": ' + b"9" * 40 + b', "op": "version"}\n',
    ]
    with AgentClient(agent_daemon.socket) as c:
        for raw in bad_lines:
            c.send_raw(raw)
            msg = c.read_message(timeout=10)
            assert msg["type"] == "error" and msg["id"] is None, msg
            assert msg["code"] in ("bad_json", "bad_args")
        assert c.result("version")["protocol"] == 1


def test_a_catastrophic_rule_is_refused_and_other_runs_go_on(agent_daemon: AgentProc, tmp_path: Path) -> None:
    slow = {"name": "slow", "kind": "progress", "regex": "(a+)+$"}
    mine = {
        "name": "mine",
        "kind": "progress",
        "contains": "step",
        "regex": r"step (?P<n>\d+)",
        "fields": {"n": "int"},
    }
    lines = ["a" * 30 + "!", "a" * 5000 + "!", VLLM_LINES[0], "a" * 5000 + " step 7", "step 3"]
    with AgentClient(agent_daemon.socket) as c:
        rep = c.request("launch", run="slow", spec=_cmd(printer(tmp_path, lines), rules=[slow]))
        assert rep["type"] == "error" and rep["code"] == "bad_args", rep
        assert "'slow'" in rep["message"] and "quantified group" in rep["message"]
        c.result("launch", run="ok", spec=_cmd(printer(tmp_path, lines, name="ok"), rules=[mine]))
        c.result("follow", run="ok", after_seq=0)
        events = _events(c.wait_for(terminal_event, timeout=15))
    kinds = [e.get("kind") for e in events]
    assert "engine_config" in kinds and events[-1]["state"] == "completed"
    # a user rule searches only the first MAX_USER_TEXT characters of a message: "step 7" lies past them
    assert [e["fields"]["n"] for e in events if e.get("fields", {}).get("rule") == "mine"] == [3]
