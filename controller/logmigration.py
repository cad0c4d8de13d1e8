"""Schema upgrade 1 → 2: the per-line ``log_lines`` rows of an older database become ``log_blocks``.

Lines of one run with consecutive ids (what one write stored) become one block; a block also ends at every
``events.log_mark`` (the last line id an event followed), so each mark maps onto a block id and the merged
feed keeps its order.  All in one transaction, then ``log_lines`` is dropped: run once, at open.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

from controller.logblocks import Block

#: Most lines in one migrated block.
MAX_LINES = 8192


def _groups(conn: sqlite3.Connection, marks: list[int]) -> Iterator[tuple[str, list[tuple[int, str]], int]]:
    """(run id, lines, first line id) in line-id order; no group holds lines on both sides of a mark."""
    group: list[tuple[int, str]] = []
    run: str | None = None
    first_id = last_id = 0
    mi = 0
    rows = conn.execute("SELECT id, run_id, offset, text FROM log_lines ORDER BY id")
    for line_id, run_id, offset, text in rows:
        crossed = mi < len(marks) and line_id > marks[mi]
        while mi < len(marks) and line_id > marks[mi]:
            mi += 1
        if group and (
            run_id != run
            or crossed
            or offset <= group[-1][0]
            or line_id != last_id + 1
            or len(group) >= MAX_LINES
        ):
            assert run is not None
            yield run, group, first_id
            group = []
        if not group:
            first_id = line_id
        run, last_id = run_id, line_id
        group.append((offset, text))
    if group and run is not None:
        yield run, group, first_id


def migrate_log_lines(conn: sqlite3.Connection) -> int:
    """Move every ``log_lines`` row into ``log_blocks`` (and remap ``events.log_mark``); returns how many
    blocks were made.  A database without ``log_lines`` is left alone."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='log_lines'").fetchone():
        return 0
    conn.execute("BEGIN IMMEDIATE")
    try:
        marks = [
            r[0] for r in conn.execute("SELECT DISTINCT log_mark FROM events WHERE log_mark > 0 ORDER BY 1")
        ]
        mapping: dict[int, int] = {}
        block_id = conn.execute("SELECT coalesce(max(id), 0) FROM log_blocks").fetchone()[0]
        made = mi = 0
        for run_id, lines, first_id in _groups(conn, marks):  # streamed: a big log_lines never sits in memory
            while mi < len(marks) and marks[mi] < first_id:
                mapping[marks[mi]] = block_id  # its lines all lie in blocks stored already
                mi += 1
            last_offset, last_text = lines[-1]
            block = Block.from_lines(lines, last_offset + len(last_text.encode()) + 1)
            cur = conn.execute(
                "INSERT INTO log_blocks(run_id, offset, end_offset, text, offsets) VALUES (?, ?, ?, ?, ?)",
                (run_id, block.offset, block.next_offset, block.text, block.blob()),
            )
            block_id, made = int(cur.lastrowid or 0), made + 1
        for mark in marks[mi:]:
            mapping[mark] = block_id
        conn.execute("CREATE TEMP TABLE mark_map(old INTEGER PRIMARY KEY, new INTEGER)")
        conn.executemany("INSERT INTO mark_map VALUES (?, ?)", mapping.items())
        conn.execute(
            "UPDATE events SET log_mark = (SELECT new FROM mark_map WHERE old = events.log_mark)"
            " WHERE log_mark > 0"
        )
        conn.execute("DROP TABLE mark_map")
        conn.execute("DROP TABLE log_lines")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return made
