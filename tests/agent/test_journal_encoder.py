"""The journal's encoder stage (agent/runs/encoder.py, a real child process) and its line encoder
(agent/runs/jsonline.py): the bytes are those of the plain JSON encoder, seqs stay consecutive and in order,
and a stage that dies or cannot encode a batch loses nothing that the daemon itself would have written."""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent.runs import journal as journal_mod
from agent.runs.encoder import ENCODER_ENV, EncoderStage, stage_wanted
from agent.runs.journal import Journal
from agent.runs.jsonline import encode_lines

TS = 1764553921.123


class Level(enum.IntEnum):
    HIGH = 3


def _plain(event: dict[str, Any]) -> bytes:
    """One line as the journal wrote it before the template and the stage: json, NaN/Infinity as null."""

    def finite(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    try:
        text = json.dumps(event, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(finite(event), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8") + b"\n"


def _milestone(i: int, **over: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "milestone",
        "kind": "throughput" if i % 2 else "progress",
        "line": 10 * i,
        "rank": None if i % 3 else i % 8,
        "fields": {"rule": "throughput", "tokens_per_s": 1000.0 + i / 7, "running": i, "ok": bool(i % 2)},
        "text": f"(APIServer pid=1000) INFO line {i}: Avg prompt throughput: {i / 3:.1f} tokens/s",
    }
    ev.update(over)
    return ev


def _events() -> list[dict[str, Any]]:
    """Milestones and other events with the values JSON is particular about."""
    odd = [
        _milestone(1, text='é ✓ 😀 \u2028 \x00 \x1f tab\t "quoted" back\\slash'),
        _milestone(2, fields={"tiny": 1e-7, "huge": 1e22, "sum": 0.1 + 0.2, "neg0": -0.0, "big": 2**70}),
        _milestone(3, fields={"nested": {"list": [1, 2.5, None, {"deep": ["x", True]}], "t": (1, 2)}}),
        _milestone(4, fields={"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 1.5}),
        _milestone(5, fields={"level": Level.HIGH, 7: "int key", None: "none key"}),
        _milestone(6, rank=Level.HIGH),
        _milestone(7, fields=[1, 2]),
        {"kind": "progress", "type": "milestone", "line": 1, "rank": None, "fields": {}, "text": ""},
        {"type": "state", "state": "completed", "reason": "exit 0", "exit": {"code": 0, "signal": None}},
        {"type": "check", "file": "f é.safetensors", "ok": False, "problems": [{"nan": math.nan}]},
    ]
    return [_milestone(i) for i in range(8, 60)] + odd + [_milestone(i) for i in range(60, 80)]


def test_encode_lines_writes_the_plain_json_bytes() -> None:
    full = [{"seq": i + 1, "ts": TS, **ev} for i, ev in enumerate(_events())]
    full.append({"seq": 999, "ts": -0.0, **_milestone(1)})
    full.append({"seq": 1000, "ts": math.nan, **_milestone(2)})
    assert encode_lines(full) == b"".join(map(_plain, full))


@pytest.fixture
def stage_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage forced on (this host may have too few CPUs for auto) and a fixed clock for the ts."""
    monkeypatch.setenv(ENCODER_ENV, "on")
    monkeypatch.setattr(journal_mod.time, "time", lambda: TS)


def _wait_ready(j: Journal) -> None:
    deadline = time.monotonic() + 30
    while j._ready_stage() is None:
        assert time.monotonic() < deadline, "the encoder stage did not start"
        time.sleep(0.01)


def _reference(tmp_path: Path, batches: list[list[dict[str, Any]]]) -> bytes:
    ref = Journal(tmp_path / "ref.jsonl")
    for batch in batches:
        ref.write_many(batch)
    ref.close()
    return (tmp_path / "ref.jsonl").read_bytes()


def _batches() -> list[list[dict[str, Any]]]:
    evs = _events()
    return [evs[i : i + 7] for i in range(0, len(evs), 7)]


@pytest.mark.usefixtures("stage_on")
def test_the_stage_writes_the_daemons_bytes_in_order(tmp_path: Path) -> None:
    batches = _batches()
    j = Journal(tmp_path / "events.jsonl")
    heard: list[int] = []
    j.subscribe(lambda ev: heard.append(ev["seq"]))
    _wait_ready(j)
    for batch in batches:
        j.submit(batch)
        time.sleep(0.02)  # the child's lines come back: written from its reply, not encoded here
    j.drain()
    assert j.stage_events > 0
    total = sum(map(len, batches))
    assert heard == list(range(1, total + 1)) and j.last_seq == total
    j.close()
    assert (tmp_path / "events.jsonl").read_bytes() == _reference(tmp_path, batches)


@pytest.mark.usefixtures("stage_on")
def test_batch_listeners_hear_each_batch_once_after_the_event_listeners(tmp_path: Path) -> None:
    batches = _batches()
    j = Journal(tmp_path / "events.jsonl")
    heard: list[tuple[str, int]] = []
    j.subscribe(lambda ev: heard.append(("event", ev["seq"])))
    j.subscribe_batches(lambda evs: heard.append(("batch", len(evs))))
    _wait_ready(j)
    for batch in batches:
        j.submit(batch)
    j.drain()
    j.append({"type": "state", "state": "completed"})
    want: list[tuple[str, int]] = []
    seq = 0
    for size in [*map(len, batches), 1]:  # the last one: the state event
        want += [("event", seq + 1 + i) for i in range(size)] + [("batch", size)]
        seq += size
    assert heard == want
    j.close()


@pytest.mark.usefixtures("stage_on")
def test_a_drain_does_not_wait_for_the_stage(tmp_path: Path) -> None:
    """Batches whose lines have not come back are encoded by the daemon itself; the child's late lines
    for them are dropped, and later batches still come from the child."""
    batches = _batches()
    j = Journal(tmp_path / "events.jsonl")
    _wait_ready(j)
    j.submit(batches[0])
    j.submit(batches[1])
    j.drain()  # straight after: most likely nothing came back yet
    for batch in batches[2:]:
        j.submit(batch)
        time.sleep(0.02)
    j.drain()
    assert j.stage_events > 0
    j.close()
    assert (tmp_path / "events.jsonl").read_bytes() == _reference(tmp_path, batches)


@pytest.mark.usefixtures("stage_on")
def test_a_stage_killed_mid_backlog_loses_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    batches = _batches()
    j = Journal(tmp_path / "events.jsonl")
    _wait_ready(j)
    assert j._stage is not None
    j.submit(batches[0])
    os.kill(j._stage.pid, signal.SIGKILL)
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="eaglewatch.agent"):
        for batch in batches[1:]:
            j.submit(batch)
        j.drain()
    assert "encoder stage failed" in caplog.text
    assert j._stage is None and j._ready_stage() is None  # this journal encodes in the daemon from now on
    j.close()
    assert (tmp_path / "events.jsonl").read_bytes() == _reference(tmp_path, batches)


@pytest.mark.usefixtures("stage_on")
def test_a_batch_nobody_can_encode_fails_as_write_many_does(tmp_path: Path) -> None:
    """The child cannot encode bytes; neither can the daemon: the batch is dropped with the daemon's
    TypeError, the batches around it are written with consecutive seqs."""
    good = _batches()
    bad = [_milestone(1, fields={"raw": b"\x00"})]
    j = Journal(tmp_path / "events.jsonl")
    heard: list[int] = []
    j.subscribe(lambda ev: heard.append(ev["seq"]))
    _wait_ready(j)
    j.submit(good[0])
    j.submit(bad)
    j.submit(good[1])
    time.sleep(0.1)
    with pytest.raises(TypeError, match="bytes"):
        j.drain()
    for batch in good[2:]:
        j.submit(batch)
    j.drain()
    total = sum(map(len, good))
    assert heard == list(range(1, total + 1))
    j.close()
    assert (tmp_path / "events.jsonl").read_bytes() == _reference(tmp_path, good)


def test_the_stage_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENCODER_ENV, raising=False)
    assert not stage_wanted()  # off unless asked for
    monkeypatch.setenv(ENCODER_ENV, "on")
    assert stage_wanted()
    monkeypatch.setenv(ENCODER_ENV, "off")
    assert not stage_wanted()
    monkeypatch.setenv(ENCODER_ENV, "yes")
    with pytest.raises(ValueError, match=f"{ENCODER_ENV} must be on, off or auto, not 'yes'"):
        stage_wanted()


def test_a_bad_stage_setting_is_logged_and_the_daemon_encodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENCODER_ENV, "yes")
    j = Journal(tmp_path / "events.jsonl")
    with caplog.at_level(logging.WARNING, logger="eaglewatch.agent"):
        j.start_stage()
        j.submit([_milestone(1)])
    assert f"{ENCODER_ENV} must be on, off or auto, not 'yes'" in caplog.text
    assert j.last_seq == 1 and j._stage is None
    j.close()


def test_a_child_that_exits_at_start_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A child that cannot import the agent (a broken package first on its path) says so instead of hanging
    the daemon. (A path without the agent is not enough: an editable install finds it anyway.)"""
    broken = tmp_path / "agent"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('a broken agent package')\n")
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    stage = EncoderStage()
    try:
        deadline = time.monotonic() + 30
        with pytest.raises(Exception, match="exited at start"):
            while not stage.poll_ready():
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        stage.close()


def test_a_daemon_with_the_stage_journals_a_backlog_once_in_order(tmp_path: Path) -> None:
    """A real daemon (stage forced on) catching up on a backlog: the engine's milestones, every seq once
    and in order at a follower, the stage's lines among them."""
    from agent.logs.splitter import LineSplitter
    from agent.milestones.engine import MilestoneEngine, load_rules
    from agent.runs.journal import scan
    from tests.helpers.agentproc import AgentClient, cleanup_runs, start_agent, terminal_event
    from tests.helpers.vllm_log import steady_lines

    data = ("\n".join(steady_lines(60_000, tp=8)) + "\n").encode()
    log = tmp_path / "big.log"
    log.write_bytes(data)
    sp, eng = LineSplitter(), MilestoneEngine(load_rules(backend="command"))
    texts = [ln.text for ln in sp.feed(data)]
    want = [m.to_dict() for i, t in enumerate(texts) for m in eng.feed(t, i + 1)] + [
        m.to_dict() for m in eng.flush()
    ]
    state = tmp_path / "state"
    agent = start_agent(state, env={ENCODER_ENV: "on"})
    try:
        with AgentClient(agent.socket, timeout=120) as c:
            # The job waits before it writes: the stage (started with the watcher) must be ready when the
            # backlog comes, or the daemon rightly encodes it all itself (a child starts in ~0.1 s; on a
            # loaded 2-core machine it once took longer than the whole backlog's reading).
            wait_then_cat = ["sh", "-c", 'sleep 3; exec cat "$1"', "sh", str(log)]
            c.result("launch", run="big", spec={"backend": "command", "command": wait_then_cat})
            c.result("follow", run="big", after_seq=0)
            seen = c.wait_for(terminal_event, timeout=120)
        events = scan(state / "runs" / "big" / "events.jsonl")
        deadline = time.monotonic() + 30  # the journal closes (and says what the stage did) after the end
        while "encoder stage encoded" not in (stderr := (state / "daemon.stderr").read_text()):
            assert time.monotonic() < deadline, stderr
            time.sleep(0.05)
    finally:
        agent.kill()
        cleanup_runs(state)
    assert "encoder stage started" in stderr
    encoded = re.search(r"the encoder stage encoded (\d+) events", stderr)
    assert encoded is not None and int(encoded[1]) > 0
    seqs = [m["event"]["seq"] for m in seen if m.get("type") == "event"]
    assert seqs == list(range(1, len(events) + 1)) == [e["seq"] for e in events]
    keys = ("kind", "line", "rank", "fields", "text")
    got = [{k: e[k] for k in keys} for e in events if e.get("type") == "milestone" and e["line"] > 0]
    assert len(want) > 500 and got == want


def test_closing_a_stage_never_waits_for_its_child() -> None:
    """A journal closes on the daemon's event loop: a child that cannot exit yet (stopped here) is left to
    a reaper thread, which collects it once it runs again."""
    stage = EncoderStage()
    proc = stage._proc
    deadline = time.monotonic() + 30
    while not stage.poll_ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        stage.close()
        assert proc.poll() is None  # close returned while the child was still there, unable to exit
        assert any(t.name == "child-reap" for t in threading.enumerate())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while proc.returncode is None:  # set by the reaper's wait: the child saw its input closed and exited
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert proc.returncode == 0 and proc.stdout is not None and proc.stdout.closed
