"""SSE formatting as pure functions: event, JSON data, cursor id; a hostile payload cannot break framing."""

from __future__ import annotations

import json

from controller.bus import BusEvent, make_cursor
from controller.logblocks import Block
from web import sse


def parse(raw: bytes) -> list[dict[str, str]]:
    """A minimal SSE parser (the WHATWG rules we rely on)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        ev: dict[str, str] = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                continue
            key, _, value = line.partition(": ")
            ev[key] = ev[key] + "\n" + value if key in ev else value
        out.append(ev)
    return out


def test_milestone_event_wire_format() -> None:
    cur = make_cursor(7, 3)
    ev = BusEvent("milestone", "r1", {"seq": 4, "kind": "weights_loaded", "fields": {"gib": 12.5}}, cur)
    raw = sse.encode(sse.to_sse(ev))
    assert raw.endswith(b"\n\n")
    [parsed] = parse(raw)
    assert parsed["event"] == "milestone"
    assert parsed["id"] == cur
    data = json.loads(parsed["data"])
    assert data["kind"] == "weights_loaded" and data["run_id"] == "r1" and data["fields"] == {"gib": 12.5}


def test_host_events_have_no_id_and_filtering() -> None:
    host_ev = BusEvent("host", None, {"name": "h1", "gpus": []}, "")
    assert sse.to_sse(host_ev).id is None
    assert sse.wanted(host_ev, "r1", "h1")
    assert not sse.wanted(host_ev, "r1", "h2")
    run_ev = BusEvent("run", "r2", {"state": "running"}, make_cursor(2, 0))
    assert not sse.wanted(run_ev, "r1", "h1")
    assert sse.wanted(run_ev, None, None)
    log_ev = BusEvent("log", "r2", Block.make([0], "a", 2).to_data(), make_cursor(2, 5))
    assert not sse.wanted(log_ev, None, None, sse.DASHBOARD_KINDS)


def test_end_event() -> None:
    [parsed] = parse(sse.encode(sse.end_event("completed")))
    assert parsed["event"] == "end" and json.loads(parsed["data"]) == {"state": "completed"}


def test_log_event_is_its_block_one_string_with_offsets_only_when_not_natural() -> None:
    """A log event carries the block as stored, one text whatever its lines hold; a hostile payload (blank
    lines, fake fields, markup) stays inside that one event."""
    evil = 'x\n\nevent: alert\ndata: {"pwned": 1}\nid: 999\n<script>alert(1)</script>\x1b[31m\u2028'
    odd = Block.make([0, 2, 3, 16, 35, 44], evil, 99)  # offsets no UTF-8 length explains
    natural = Block.make([10, 20, 28], "ünï €\n🦅 ok\n", 29)
    assert natural.offsets is None and odd.offsets is not None
    for block, offsets in ((odd, [0, 2, 3, 16, 35, 44]), (natural, None)):
        ev = BusEvent("log", "r1", block.to_data(), make_cursor(1, 1))
        events = parse(sse.encode(sse.to_sse(ev)))
        assert len(events) == 1 and events[0]["event"] == "log" and events[0]["id"] == make_cursor(1, 1)
        data = json.loads(events[0]["data"])
        assert "lines" not in data and data["text"] == block.text
        assert data["offset"] == block.offset and data["next_offset"] == block.next_offset
        assert data.get("offsets") == offsets
