"""Journal events forwarded undecoded: raw lines framed as ``event`` messages, exactly once by seq."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent import protocol
from agent.paths import run_paths
from agent.runs.journal import Journal, read_raw, scan
from tests.helpers.agentjobs import marker, printer
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon, decode_messages, terminal_event

__all__ = ["agent_daemon"]


def test_raw_frames_are_the_encoded_events_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    journal = Journal(path)
    journal.append_many(
        [
            {
                "type": "milestone",
                "kind": "progress",
                "fields": {"samples_done": 3},
                "text": "naïve \u2028 ✓",
            },
            {"type": "check", "file": "a.safetensors", "ok": False, "problems": [{"mean": float("nan")}]},
            {"type": "state", "state": "running"},
        ]
    )
    journal.close()
    found, offset = read_raw(path, 0)
    assert [seq for seq, _ in found] == [1, 2, 3] and offset == path.stat().st_size
    expected = b"".join(protocol.encode({"type": "event", "run": "r-1", "event": ev}) for ev in scan(path))
    assert protocol.event_frames("r-1", [raw for _, raw in found]) == expected
    assert decode_messages(expected)[1]["event"]["problems"] == [{"mean": None}]
    # the same frames from the lines as they lie in the file, all at once
    assert protocol.event_block_frames("r-1", path.read_bytes()) == expected
    assert protocol.event_block_frames("r-1", b"") == b""


def test_lines_written_otherwise_are_decoded_once_and_bad_ones_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(
        b'{"seq":1,"ts":1.5,"type":"state","state":"running"}\n'
        b'{ "ts": 2, "seq": 2, "type": "state", "state": "x y" }\n'  # another key order and spacing
        b'{"seq":1_0,"ts":3}\n'  # not JSON although int() would read the seq
        b"not json\n"
        b"[1, 2]\n"
        b'{"ts": 4, "type": "state"}\n'  # no seq
        b'{"seq":3,"ts":5,"type":"sta'  # torn: not complete yet
    )
    found, offset = read_raw(path, 0)
    assert found == [
        (1, b'{"seq":1,"ts":1.5,"type":"state","state":"running"}'),
        (2, b'{"ts":2,"seq":2,"type":"state","state":"x y"}'),
    ]
    assert offset == path.read_bytes().rindex(b"\n") + 1
    assert read_raw(tmp_path / "missing.jsonl", 7) == ([], 7)


def _event_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    events = [m for m in msgs if m.get("type") == "event"]
    # One line, one event, the message an older controller reads: nothing else in it.
    assert all(set(m) == {"type", "run", "event"} and m["run"] == "fr" for m in events)
    return [m["event"] for m in events]


def test_exactly_once_in_order_across_a_reconnect(agent_daemon: AgentProc, tmp_path: Path) -> None:
    lines = [marker("progress", samples_done=i, samples_total=60) for i in range(60)]
    spec = {
        "name": "t",
        "host": "local",
        "backend": "command",
        "command": printer(tmp_path, lines, delay=0.02),
    }
    with AgentClient(agent_daemon.socket) as first:
        first.result("launch", run="fr", spec=spec)
        first.result("follow", run="fr", after_seq=0)
        before = _event_messages(
            first.wait_for(lambda m: m.get("type") == "event" and m["event"]["seq"] >= 10)
        )
    # The link dropped mid-run, with events possibly still in flight; the follower resumes from what it has.
    with AgentClient(agent_daemon.socket) as second:
        second.result("follow", run="fr", after_seq=before[-1]["seq"])
        after = _event_messages(second.wait_for(terminal_event))
    got = before + after
    assert [e["seq"] for e in got] == list(range(1, len(got) + 1))
    assert got == scan(run_paths(agent_daemon.state_dir, "fr").events)
    assert sum(1 for e in got if e.get("kind") == "progress") == 60
