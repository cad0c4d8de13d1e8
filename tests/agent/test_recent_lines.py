"""The journal's newest lines in memory (agent/runs/journal.py): what live followers take, not the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.runs.journal import Journal, RecentLines, read_raw


def test_a_follower_at_a_write_start_gets_every_line_after_it() -> None:
    recent = RecentLines(end=100)
    recent.add(5, b"five\nsix\n")  # seqs 5-6 at bytes 100..109
    recent.add(7, b"seven\n")  # seq 7 at 109..115
    assert recent.after(4, 100) == (b"five\nsix\nseven\n", 115)
    assert recent.after(6, 109) == (b"seven\n", 115)
    assert recent.after(7, 115) == (b"", 115)  # caught up


def test_a_follower_elsewhere_is_sent_to_the_file() -> None:
    recent = RecentLines(end=100)
    recent.add(5, b"five\nsix\n")
    recent.add(7, b"seven\n")
    assert recent.after(5, 105) is None  # half way through a write
    assert recent.after(3, 90) is None  # before what is held
    assert recent.after(6, 100) is None  # a seq and an offset that do not belong together
    assert recent.after(0, 0) is None  # a follower starting from the top of an older file


def test_old_writes_are_dropped_past_the_limit_but_the_last_one_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("agent.runs.journal.RECENT_BYTES", 10)
    recent = RecentLines(end=0)
    recent.add(1, b"aaaa\n")
    recent.add(2, b"bbbb\n")
    recent.add(3, b"cccc\n")  # 15 bytes held: the first write goes
    assert recent.after(0, 0) is None
    assert recent.after(1, 5) == (b"bbbb\ncccc\n", 15)
    recent.add(4, b"x" * 40 + b"\n")  # bigger than the limit alone: kept, the others go
    assert recent.after(3, 15) == (b"x" * 40 + b"\n", 56)
    assert recent.after(2, 10) is None


def test_the_journal_holds_what_it_wrote_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    journal = Journal(path)
    journal.append_many([{"type": "state", "state": "running"}])
    size = path.stat().st_size
    journal.append_many([{"type": "milestone", "kind": "progress", "n": i} for i in range(3)])
    journal.append({"type": "state", "state": "completed"})
    lines, end = journal.recent.after(1, size) or (b"", -1)
    assert lines == path.read_bytes()[size:] and end == path.stat().st_size
    found, offset = read_raw(path, size)
    assert [seq for seq, _ in found] == [2, 3, 4, 5] and offset == end
    journal.close()
    reopened = Journal(path)  # a restarted daemon holds none of the old lines: its followers read the file
    assert reopened.recent.after(1, size) is None and reopened.recent.after(5, end) == (b"", end)
    reopened.close()
