"""History at scale on a real SQLite file: paging through 10,000 runs, and gc of ended runs' log lines."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from controller import queries
from controller.service import Controller
from controller.settings import Settings
from tests.helpers.history import seed_keepers, seed_log, seed_runs

DAY = 86400.0


@pytest.fixture
async def ctl(local_settings: Settings) -> AsyncIterator[Controller]:
    """A started Controller with nothing to supervise."""
    c = Controller(local_settings, supervise=False)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


async def test_paging_through_10000_runs(ctl: Controller) -> None:
    ids = seed_runs(ctl.settings.database, 10_000)
    assert await ctl.count_runs() == 10_000
    first = await ctl.list_runs(100, 0)
    assert [r.id for r in first] == ids[::-1][:100]  # newest first
    seen: list[str] = []
    for offset in range(0, 10_000, 1000):
        seen += [r.id for r in await ctl.list_runs(1000, offset)]
    assert seen == ids[::-1]
    assert await ctl.list_runs(100, 10_000) == []
    assert [r.id for r in await ctl.list_runs(5, 9_998)] == ids[1::-1]


async def test_gc_drops_old_lines_and_keeps_the_rest(ctl: Controller) -> None:
    db = ctl.settings.database
    now = time.time()
    old = seed_runs(db, 3, ended_at=now - 40 * DAY, prefix="old")
    recent = seed_runs(db, 1, ended_at=now - 1 * DAY, prefix="new")
    running = seed_runs(db, 1, state="running", ended_at=None, prefix="live")
    for rid in old + recent + running:
        seed_log(db, rid, 20_000)
        seed_keepers(db, rid)
    before = {rid: await ctl.get_run(rid) for rid in old}

    done = await ctl.gc(30 * DAY)

    assert done["runs"] == 3 and done["lines"] == 60_000
    assert done["bytes_after"] < done["bytes_before"] * 0.6  # 3 of 5 runs' lines gone: VACUUM shrank it
    assert db.stat().st_size == done["bytes_after"]
    for rid in old:
        assert await ctl.read_log(rid, limit=10) == []
        after = await ctl.get_run(rid)
        assert after.milestones == before[rid].milestones and after.milestones
        assert after.problems == before[rid].problems and after.problems
        assert after.spec == before[rid].spec and after.verdict == before[rid].verdict
    for rid in recent + running:
        lines = await ctl.read_log(rid, before_offset=2**62, limit=1)
        assert lines[0]["text"].startswith("line 000019999")
    again = await ctl.gc(30 * DAY)
    assert again["lines"] == 0 and again["bytes_after"] == again["bytes_before"]  # nothing left to drop


async def test_ended_before_ignores_runs_without_an_end(ctl: Controller) -> None:
    db = ctl.settings.database
    seed_runs(db, 2, state="failed", ended_at=None, prefix="odd")
    assert await ctl.store.read(queries.ended_before, time.time()) == []
