"""``eaglewatch gc`` as a real subprocess on a tmp EAGLEWATCH_HOME seeded straight through SQLite."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from tests.cli.test_commands import cli
from tests.helpers.history import seed_keepers, seed_log, seed_runs


def test_gc_drops_old_log_lines_keeps_milestones(tmp_path: Path) -> None:
    empty = cli(tmp_path, "gc", "--older-than", "30d", "--json")  # also creates the database
    assert empty.returncode == 0, empty.stderr
    assert json.loads(empty.stdout)["lines"] == 0
    db = tmp_path / "home" / "eaglewatch.db"
    (old,) = seed_runs(db, 1, ended_at=time.time() - 31 * 86400, prefix="old")
    (new,) = seed_runs(db, 1, ended_at=time.time() - 29 * 86400, prefix="new")
    for rid in (old, new):
        seed_log(db, rid, 5000)
        seed_keepers(db, rid)
    r = cli(tmp_path, "gc", "--older-than", "30d")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("dropped 5000 log lines of 1 ended runs; database ")
    conn = sqlite3.connect(db)
    counts = {
        rid: [conn.execute(f"SELECT count(*) FROM {t} WHERE run_id=?", (rid,)).fetchone()[0] for t in
              ("log_blocks", "milestones", "problems")]
        for rid in (old, new)
    }  # fmt: skip
    conn.close()
    assert counts == {old: [0, 1, 1], new: [10, 1, 1]}


def test_gc_refuses_a_bad_age(tmp_path: Path) -> None:
    for bad in ("30", "-1d", "0d", "thirty days"):
        r = cli(tmp_path, "gc", "--older-than", bad)
        assert r.returncode == 2 and "--older-than" in r.stderr and "30d" in r.stderr, (bad, r.stderr)
