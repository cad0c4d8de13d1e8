"""Journal recovery (torn last line, seq continuity), offset reads across truncation, inotify wake-ups."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agent.logs.tail import Broadcast, Inotify, Pulse, read_from
from agent.runs.journal import Journal, read_raw, scan


def test_journal_seq_and_recovery_of_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    j = Journal(path)
    assert j.append({"type": "state", "state": "running"})["seq"] == 1
    assert [e["seq"] for e in j.append_many([{"type": "x"}, {"type": "y"}])] == [2, 3]
    with pytest.raises(TypeError, match="bytes"):  # nothing written, no seq taken
        j.append_many([{"type": "x"}, {"type": "raw", "data": b"\x00"}])
    assert j.last_seq == 3
    j.close()
    with open(path, "ab") as fh:
        fh.write(b'{"seq": 4, "type": "tor')
    j2 = Journal(path)
    assert j2.last_seq == 3
    assert path.read_bytes().endswith(b"}\n")  # the torn tail is gone
    j2.append({"type": "z"})
    j2.close()
    assert [e["seq"] for e in scan(path)] == [1, 2, 3, 4]


def test_journal_recovers_seq_from_a_long_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    j = Journal(path)
    j.append_many([{"type": "milestone", "text": "x" * 5000} for _ in range(100)])
    j.close()
    assert Journal(path).last_seq == 100
    only_torn = tmp_path / "torn.jsonl"
    only_torn.write_bytes(b'{"seq": 1, "ty')
    assert Journal(only_torn).last_seq == 0 and only_torn.read_bytes() == b""


def test_reads_stop_at_the_last_complete_line(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    path.write_bytes(json.dumps({"seq": 1}).encode() + b"\n" + b'{"seq": 2')
    assert [e["seq"] for e in scan(path)] == [1]
    lines, offset = read_raw(path, 0)
    assert [seq for seq, _ in lines] == [1] and offset == len(json.dumps({"seq": 1})) + 1
    assert scan(tmp_path / "missing") == [] and read_raw(tmp_path / "missing", 5) == ([], 5)


def test_read_from_follows_growth_and_resets_on_truncation(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    assert read_from(log, 0, 100).data == b""  # not there yet
    log.write_bytes(b"hello\nworld\n")
    r = read_from(log, 6, 100)
    assert (r.data, r.offset, r.reset, r.size) == (b"world\n", 6, False, 12)
    assert read_from(log, 0, 3).data == b"hel"
    log.write_bytes(b"new\n")  # truncated and rewritten (rotation)
    r = read_from(log, 12, 100)
    assert (r.data, r.offset, r.reset) == (b"new\n", 0, True)


async def test_inotify_wakes_on_file_changes(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    ino = Inotify(loop)
    pulse = Pulse()
    try:
        ino.watch("run", tmp_path, pulse.notify)
        assert await pulse.wait(0.05) is False
        (tmp_path / "output.log").write_text("x\n")
        assert await pulse.wait(5) is True
        ino.unwatch("run")
        while await pulse.wait(0.1):  # drain what arrived before unwatching
            pass
        (tmp_path / "output.log").write_text("y\n")
        assert await pulse.wait(0.2) is False
    finally:
        ino.close()


async def test_broadcast_wakes_every_waiter_and_misses_nothing() -> None:
    b = Broadcast()
    gen = b.generation
    b.notify()  # before anyone waits: a waiter that read `gen` earlier still returns at once
    assert await b.wait_past(gen, 5) == gen + 1
    waiters = [asyncio.create_task(b.wait_past(b.generation, 5)) for _ in range(3)]
    await asyncio.sleep(0)
    b.notify()
    assert await asyncio.gather(*waiters) == [gen + 2] * 3
    assert await b.wait_past(b.generation, 0.01) == gen + 2  # times out quietly


def test_journal_writes_non_finite_numbers_as_null(tmp_path: Path) -> None:
    j = Journal(tmp_path / "events.jsonl")
    j.append({"type": "check", "file": "hs_0", "ok": False, "problems": [{"max": float("nan")}]})
    j.append({"type": "milestone", "fields": {"tok_s": float("inf"), "low": [float("-inf"), 1.5]}})
    lines = (tmp_path / "events.jsonl").read_text().splitlines()

    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} is not JSON")

    first, second = (json.loads(line, parse_constant=refuse) for line in lines)
    assert first["problems"] == [{"max": None}]
    assert second["fields"] == {"tok_s": None, "low": [None, 1.5]} and second["seq"] == 2


def test_journal_events_are_readable_before_a_deferred_fsync(tmp_path: Path) -> None:
    """append_many(sync=False): readers see the events at once; sync() makes them durable."""
    j = Journal(tmp_path / "events.jsonl")
    written = j.append_many([{"type": "milestone", "kind": "progress"}, {"type": "x"}], sync=False)
    assert [e["seq"] for e in written] == [1, 2] and j.unsynced  # the fsync is still to come
    assert [e["seq"] for e in scan(j.path)] == [1, 2]
    j.sync()
    assert not j.unsynced
    assert j.append({"type": "y"})["seq"] == 3 and not j.unsynced  # the default fsyncs before returning
    j.close()
    j.sync()  # nothing waits and the file is closed: a no-op
    assert Journal(tmp_path / "events.jsonl").last_seq == 3
