"""A real daemon catching up on a large log (raw blocks, fsyncs in a thread while it splits on) journals
exactly the milestones of the line-by-line engine, once each with consecutive seqs, and a follower gets
exactly the log's lines."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from agent.logs.splitter import LineSplitter
from agent.milestones.engine import MilestoneEngine, load_rules
from agent.runs.journal import scan
from tests.helpers.agentproc import AgentClient, cleanup_runs, log_lines, start_agent, terminal_event
from tests.helpers.vllm_log import make_log, steady_lines


def _reference(data: bytes) -> tuple[list[dict[str, Any]], list[str]]:
    """Milestones and lines of the line-by-line path over the whole log."""
    sp, eng = LineSplitter(), MilestoneEngine(load_rules(backend="command"))
    texts = [ln.text for ln in sp.feed(data) + sp.flush()]
    out = [m for i, t in enumerate(texts) for m in eng.feed(t, i + 1)] + eng.flush()
    return [m.to_dict() for m in out], texts


def test_a_backlog_journals_the_line_by_line_milestones(tmp_path: Path) -> None:
    rnd = random.Random(7)
    parts = [make_log(tp=4, colours=True)]
    parts += [("\n".join(steady_lines(20_000, tp=4, seed=i)) + "\n").encode() for i in range(6)]
    parts.insert(3, "bad \xff utf-8 and é\n".encode("latin-1") + b"x" * 100_000 + b"\n")
    parts.append(make_log(tp=4, failure=rnd.choice(["oom", "nccl", "killed"])))
    data = b"".join(parts) + b"INFO no newline at the end"
    log = tmp_path / "big.log"
    log.write_bytes(data)
    want, texts = _reference(data)
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        with AgentClient(agent.socket, timeout=120) as c:
            c.result("launch", run="big", spec={"backend": "command", "command": ["cat", str(log)]})
            c.result("follow", run="big", after_seq=0, log_offset=0)
            seen = c.wait_for(terminal_event, timeout=120)
            # log lines may still be on their way after the final state
            lines = [t for m in seen for _, t in log_lines(m)]
            while len(lines) < len(texts):
                lines += [t for _, t in log_lines(c.read_message(30))]
        events = scan(state / "runs" / "big" / "events.jsonl")
    finally:
        agent.kill()
        cleanup_runs(state)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    keys = ("kind", "line", "rank", "fields", "text")
    got = [{k: e[k] for k in keys} for e in events if e.get("type") == "milestone" and e["line"] > 0]
    assert len(want) > 500
    assert got[: len(want)] == want
    assert [e["kind"] for e in got[len(want) :]] == ["failed"]  # the watcher's verdict on the job's end
    assert lines == texts
