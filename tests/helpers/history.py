"""Seed a controller database straight through SQLite (executemany): many runs, many log lines, fast."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

SPEC = json.dumps({"host": "h", "backend": "command", "command": ["true"]})
#: lines per stored log block (the ingest path stores blocks of a few hundred lines too)
BLOCK_LINES = 500


def seed_runs(
    db: Path, n: int, *, state: str = "completed", ended_at: float | None = 1000.0, prefix: str = "r"
) -> list[str]:
    """``n`` runs on host ``h``, created one second apart (``{prefix}-00000`` oldest); their ids."""
    ids = [f"{prefix}-{i:05d}" for i in range(n)]
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(
            "INSERT OR IGNORE INTO hosts(name, ssh, python, created_at, gpus_json, reachable)"
            " VALUES ('h','local','python3',0,'[]',1)"
        )
        conn.executemany(
            "INSERT INTO runs(id, name, host, backend, spec_json, state, created_at, ended_at, last_seq,"
            " log_offset) VALUES (?,?,?,?,?,?,?,?,0,0)",
            [
                (rid, f"run {i}", "h", "command", SPEC, state, 500.0 + i, ended_at)
                for i, rid in enumerate(ids)
            ],
        )
    conn.close()
    return ids


def seed_log(db: Path, run_id: str, lines: int, width: int = 100) -> None:
    """``lines`` log lines of ``width`` bytes each for ``run_id``, in blocks, at their natural offsets."""
    conn = sqlite3.connect(db)
    rows = []
    for start in range(0, lines, BLOCK_LINES):
        count = min(BLOCK_LINES, lines - start)
        texts = [f"line {start + k:09d} ".ljust(width - 1, "x") for k in range(count)]
        rows.append((run_id, start * width, (start + count) * width, "\n".join(texts)))
    with conn:
        conn.executemany("INSERT INTO log_blocks(run_id, offset, end_offset, text) VALUES (?,?,?,?)", rows)
        conn.execute("UPDATE runs SET log_offset=? WHERE id=?", (lines * width, run_id))
    conn.close()


def seed_keepers(db: Path, run_id: str) -> None:
    """A milestone and a problem for ``run_id``: what gc must keep."""
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(
            "INSERT INTO milestones(run_id, seq, kind, at, fields_json, text)"
            " VALUES (?,1,'model_loaded',1,'{}','m')",
            (run_id,),
        )
        conn.execute(
            "INSERT INTO problems(run_id, seq, idx, code, file, message, at)"
            " VALUES (?,2,0,'nan','a.pt','NaN',2)",
            (run_id,),
        )
    conn.close()
