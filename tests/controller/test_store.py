"""Store, ingest and feed on a real SQLite file: exactly-once, ordering, cursors, failure isolation."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from controller import crud, queries
from controller.alerts import AlertPolicy
from controller.bus import Bus, BusEvent, parse_cursor
from controller.lifecycle import RunEvent
from controller.logblocks import Block
from controller.store import Store, Tx, connect

QUIET = AlertPolicy(cooldown_s=0, deliver=False)


def _block(lines: list[tuple[int, str]], nxt: int | None = None) -> Block:
    """A block of ``(offset, text)`` lines; ``nxt`` defaults to the natural offset after the last."""
    last_o, last_t = lines[-1]
    nxt = nxt if nxt is not None else last_o + len(last_t.encode()) + 1
    return Block.make([o for o, _ in lines], "\n".join(t for _, t in lines), nxt)


def _run(tx: Tx, run_id: str = "r-1", spec: dict[str, Any] | None = None) -> None:
    tx.conn.execute(
        "INSERT INTO hosts(name, ssh, python, created_at, gpus_json) VALUES ('h','local','python3',0,'[]')"
        " ON CONFLICT DO NOTHING"
    )
    spec = spec or {"host": "h", "backend": "command", "command": ["true"]}
    tx.conn.execute(
        "INSERT INTO runs(id, name, host, backend, spec_json, state, created_at, last_seq, log_offset)"
        " VALUES (?,?,?,?,?,'pending',?,0,0)",
        (run_id, "run", "h", "command", json.dumps(spec), tx.now),
    )
    crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCH, policy=QUIET)
    crud.transition(tx=tx, run_id=run_id, event=RunEvent.LAUNCHED, policy=QUIET)


def _milestone(seq: int, kind: str = "progress", **fields: Any) -> dict[str, Any]:
    return {
        "seq": seq,
        "ts": 1000.0 + seq,
        "type": "milestone",
        "kind": kind,
        "line": seq,
        "rank": None,
        "fields": fields,
        "text": f"line {seq}",
    }


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    s = Store(tmp_path / "ew.db", Bus())
    await s.open()
    yield s
    await s.close()


async def test_schema_wal_and_version(store: Store, tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "ew.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT max(version) FROM schema_version").fetchone()[0] == 2
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"hosts", "runs", "events", "milestones", "problems", "alerts", "outbox", "log_blocks"} <= tables
    conn.close()


async def test_events_exactly_once_in_order(store: Store) -> None:
    await store.write(_run)
    events = [_milestone(i) for i in range(1, 51)]
    # first delivery, then a replay overlapping it (reconnect), then the rest
    await store.write(lambda tx: crud.apply_events(tx=tx, run_id="r-1", events=events[:30], policy=QUIET))
    await store.write(lambda tx: crud.apply_events(tx=tx, run_id="r-1", events=events[10:40], policy=QUIET))
    await store.write(lambda tx: crud.apply_events(tx=tx, run_id="r-1", events=events, policy=QUIET))
    detail = await store.read(queries.get_run_detail, "r-1")
    assert [m.seq for m in detail.milestones] == list(range(1, 51))
    row = await store.read(queries.run_row, "r-1")
    assert row["last_seq"] == 50
    assert detail.progress == {} and detail.last_milestone == "progress"


async def test_state_events_and_terminal(store: Store) -> None:
    await store.write(_run)
    evs = [
        _milestone(1),
        {"seq": 2, "ts": 5.0, "type": "state", "state": "completed", "exit": {"code": 0}},
        {"seq": 3, "ts": 6.0, "type": "state", "state": "running"},
    ]
    await store.write(lambda tx: crud.apply_events(tx=tx, run_id="r-1", events=evs, policy=QUIET))
    run = await store.read(queries.get_run_public, "r-1")
    assert run.state == "completed" and run.exit == {"code": 0} and run.ended_at == 5.0


async def test_failed_check_raises_alert_and_leaves_the_stop_to_the_agent(store: Store) -> None:
    await store.write(
        lambda tx: _run(
            tx, spec={"host": "h", "backend": "command", "command": ["x"], "on_shape_failure": "stop"}
        )
    )
    check = {
        "seq": 1,
        "ts": 2.0,
        "type": "check",
        "file": "/o/hs_0.safetensors",
        "ok": False,
        "format": "x",
        "problems": [{"code": "hidden_dim_lost", "file": "/o/hs_0.safetensors", "message": "flat"}],
    }
    applied = await store.write(
        lambda tx: crud.apply_events(
            tx=tx, run_id="r-1", events=[check], policy=AlertPolicy(cooldown_s=60, deliver=True)
        )
    )
    assert applied == 1  # recorded; on_shape_failure=stop is the agent's to act on (agent/runs/watcher.py)
    detail = await store.read(queries.get_run_detail, "r-1")
    assert [p.code for p in detail.problems] == ["hidden_dim_lost"]
    assert [a.rule for a in detail.alerts] == ["shape_check_failed"]
    assert detail.open_alerts == 1


def _check(seq: int, file: str, *codes: str) -> dict[str, Any]:
    problems = [{"code": c, "file": file, "message": f"{c} in {file}"} for c in codes]
    return {"seq": seq, "ts": 2.0 + seq, "type": "check", "file": file, "ok": False, "problems": problems}


async def test_one_alert_per_distinct_problem_of_a_run(store: Store) -> None:
    """Three different problems raise three alerts; the same problem again, in another file or a
    milestone, raises none; an error class is a problem of its own."""
    await store.write(_run)
    events = [
        _check(1, "/o/hs_0.safetensors", "layer_count_mismatch", "non_finite"),
        _check(2, "/o/hs_1.safetensors", "hidden_dim_lost"),
        _check(3, "/o/hs_2.safetensors", "non_finite", "non_finite"),
        _milestone(4, "shape_check_failed", code="hidden_dim_lost", message="flat"),
        _milestone(5, "error", **{"class": "oom"}),
        _milestone(6, "error", **{"class": "oom"}),
        _milestone(7, "error", **{"class": "nccl"}),
    ]
    policy = AlertPolicy(cooldown_s=600, deliver=False)
    await store.write(lambda tx: crud.apply_events(tx=tx, run_id="r-1", events=events, policy=policy))
    detail = await store.read(queries.get_run_detail, "r-1")
    shape = sorted(a.message.split(": ", 2)[2] for a in detail.alerts if a.rule == "shape_check_failed")
    assert shape == [
        "hidden_dim_lost: hidden_dim_lost in /o/hs_1.safetensors",
        "layer_count_mismatch: layer_count_mismatch in /o/hs_0.safetensors",
        "non_finite: non_finite in /o/hs_0.safetensors",
    ]
    assert sorted(a.message.split(" ")[2] for a in detail.alerts if a.rule == "error") == [
        "(nccl):",
        "(oom):",
    ]
    assert len(detail.problems) == 5  # every problem is kept; only the alerts are one per problem


async def test_log_lines_idempotent_and_offset(store: Store) -> None:
    await store.write(_run)
    lines = [(i * 10, f"line {i}") for i in range(100)]
    n1 = await store.write(partial(crud.add_log_block, run_id="r-1", block=_block(lines[:60], 600)))
    n2 = await store.write(partial(crud.add_log_block, run_id="r-1", block=_block(lines[40:], 1000)))
    assert (n1, n2) == (60, 40)
    got = await store.read(queries.read_log, "r-1", -1, 1000, None, False)
    assert [g["offset"] for g in got] == [i * 10 for i in range(100)]
    assert (await store.read(queries.run_row, "r-1"))["log_offset"] == 1000
    tail = await store.read(queries.read_log, "r-1", 950, 10, None, False)
    assert [g["text"] for g in tail] == ["line 96", "line 97", "line 98", "line 99"]
    back = await store.read(queries.read_log, "r-1", -1, 3, None, False, 500)
    assert [g["text"] for g in back] == ["line 47", "line 48", "line 49"]
    found = await store.read(queries.read_log, "r-1", -1, 10, "LINE 7", False)
    assert [g["text"] for g in found][:2] == ["line 7", "line 70"]


async def test_failing_write_is_isolated(store: Store) -> None:
    await store.write(_run)

    def bad(tx: Tx) -> None:
        tx.conn.execute("UPDATE runs SET name='changed' WHERE id='r-1'")
        raise RuntimeError("boom")

    ok = store.submit(partial(crud.add_log_block, run_id="r-1", block=_block([(0, "a")])))
    failing = store.submit(bad)
    ok2 = store.submit(partial(crud.add_log_block, run_id="r-1", block=_block([(2, "b")])))
    assert await ok == 1 and await ok2 == 1
    with pytest.raises(RuntimeError, match="boom"):
        await failing
    assert (await store.read(queries.run_row, "r-1"))["name"] == "run"


async def test_the_feed_reads_events_and_log_lines_from_one_snapshot(store: Store) -> None:
    """A write committed between the feed's two SELECTs must not show in the second one."""
    await store.write(_run)
    conn = connect(store.path)
    try:
        with queries._snapshot(conn):
            seen = conn.execute("SELECT count(*) FROM events").fetchone()[0]
            await store.write(partial(crud.add_log_block, run_id="r-1", block=_block([(0, "late")])))
            assert conn.execute("SELECT count(*) FROM log_blocks").fetchone()[0] == 0
            assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == seen
        assert conn.execute("SELECT count(*) FROM log_blocks").fetchone()[0] == 1
    finally:
        conn.close()


async def test_feed_since_replays_what_the_bus_published(store: Store) -> None:
    sub = store.bus.subscribe()
    await store.write(_run)
    for i in range(1, 6):
        await store.write(partial(crud.apply_events, run_id="r-1", events=[_milestone(i)], policy=QUIET))
        block = _block([(i * 100, f"l{i}a"), (i * 100 + 5, f"l{i}b")], i * 100 + 10)
        await store.write(partial(crud.add_log_block, run_id="r-1", block=block))
    live: list[BusEvent] = []
    while not sub._queue.empty():
        item = sub._queue.get_nowait()
        assert item is not None
        live.append(item)
    cursors = [e.cursor for e in live]
    assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors)
    replay = await store.read(queries.feed_since, "r-1", None, 1000)
    assert [(e.kind, e.data) for e in replay] == [(e.kind, e.data) for e in live]
    # resume from the middle: exactly the rest
    mid = live[len(live) // 2]
    rest = await store.read(queries.feed_since, "r-1", mid.cursor, 1000)
    assert [e.cursor for e in rest] == cursors[len(live) // 2 + 1 :]
    assert parse_cursor(mid.cursor)[0] > 0


async def test_concurrent_readers_while_writing(store: Store) -> None:
    await store.write(_run)

    async def writer() -> None:
        for i in range(50):
            await store.write(partial(crud.add_log_block, run_id="r-1", block=_block([(i, "x")], i + 1)))

    async def reader() -> None:
        for _ in range(50):
            await store.read(queries.list_runs)
            await asyncio.sleep(0)

    await asyncio.gather(writer(), reader(), reader())
    assert len(await store.read(queries.read_log, "r-1", -1, 1000, None, False)) == 50


# --- batches: many stream messages, one transaction (crud.apply_event_batch, supervisor.EventQueue) ---


async def _stored(store: Store, run_id: str) -> tuple[list[int], int]:
    detail = await store.read(queries.get_run_detail, run_id)
    row = await store.read(queries.run_row, run_id)
    return [m.seq for m in detail.milestones], row["last_seq"]


async def test_batch_with_a_duplicate_seq_stores_it_once(store: Store) -> None:
    await store.write(_run)
    batch = [("r-1", _milestone(1)), ("r-1", _milestone(2)), ("r-1", _milestone(2)), ("r-1", _milestone(3))]
    applied = await store.write(partial(crud.apply_event_batch, events=batch, policy=QUIET))
    assert applied == 3 and await _stored(store, "r-1") == ([1, 2, 3], 3)
    again = await store.write(partial(crud.apply_event_batch, events=batch, policy=QUIET))
    assert again == 0 and await _stored(store, "r-1") == ([1, 2, 3], 3)


async def test_batch_spanning_two_runs_keeps_each_runs_order(store: Store) -> None:
    await store.write(_run)
    await store.write(partial(_run, run_id="r-2"))
    sub = store.bus.subscribe()
    batch = [
        (r, _milestone(i, "weights_loaded" if i == 2 else "progress"))
        for i in range(1, 6)
        for r in ("r-1", "r-2")
    ]
    applied = await store.write(partial(crud.apply_event_batch, events=batch, policy=QUIET))
    assert applied == 10
    for run_id in ("r-1", "r-2"):
        assert await _stored(store, run_id) == ([1, 2, 3, 4, 5], 5)
        detail = await store.read(queries.get_run_detail, run_id)
        assert detail.last_milestone == "progress"
    runs_published = []
    while not sub._queue.empty():
        item = sub._queue.get_nowait()
        if item is not None and item.kind == "run":
            runs_published.append(item.run_id)
    assert sorted(runs_published) == ["r-1", "r-2"]  # one public view per run per batch, not per milestone


async def test_crash_mid_batch_loses_nothing(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that fails half-way stores none of it; the agent's replay after last_seq stores all once."""
    await store.write(_run)
    await store.write(partial(_run, run_id="r-2"))
    batch = [(r, _milestone(i)) for r in ("r-1", "r-2") for i in range(1, 4)]
    real = crud.add_event
    calls = 0

    def failing(**kw: Any) -> bool:
        nonlocal calls
        calls += 1
        if calls == 5:  # in the middle of the second run's events
            raise sqlite3.OperationalError("disk I/O error")
        return real(**kw)

    monkeypatch.setattr(crud, "add_event", failing)
    with pytest.raises(sqlite3.OperationalError):
        await store.write(partial(crud.apply_event_batch, events=batch, policy=QUIET))
    monkeypatch.setattr(crud, "add_event", real)
    for run_id in ("r-1", "r-2"):
        assert await _stored(store, run_id) == ([], 0)
    replay = [(r, _milestone(i)) for r in ("r-1", "r-2") for i in range(1, 5)]
    assert await store.write(partial(crud.apply_event_batch, events=replay, policy=QUIET)) == 8
    for run_id in ("r-1", "r-2"):
        assert await _stored(store, run_id) == ([1, 2, 3, 4], 4)


async def test_event_queue_one_write_takes_all_and_none_is_left_behind(store: Store) -> None:
    from controller.supervisor import EventQueue

    await store.write(_run)
    queue, writes = EventQueue(), 0
    futs = []
    for i in range(1, 201):
        if queue.put("r-1", _milestone(i)):
            writes += 1
            futs.append(
                store.submit(lambda tx: crud.apply_event_batch(tx=tx, events=queue.take(), policy=QUIET))
            )
        if i % 50 == 0:
            await asyncio.sleep(0)
    await asyncio.gather(*futs)
    assert await _stored(store, "r-1") == (list(range(1, 201)), 200)
    assert writes < 200 and sum(f.result() for f in futs) == 200
    queue.fail()
    assert not queue.put("r-1", _milestone(201)) and queue.take() == [] and len(queue) == 0


@pytest.mark.parametrize("checkpoint_s", [0.05, 1000.0])
async def test_the_writer_never_checkpoints_the_checkpointer_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_s: float
) -> None:
    """A WAL checkpoint fsyncs the database: never on the writer's commit path (p99 latency), but soon."""
    from controller import store as store_mod

    monkeypatch.setattr(store_mod, "CHECKPOINT_S", checkpoint_s)
    s = Store(tmp_path / "ew.db", Bus())
    await s.open()
    try:
        await s.write(_run)
        size = (tmp_path / "ew.db").stat().st_size
        for start in range(0, 6000, 500):  # ~6 MB of WAL: past SQLite's default autocheckpoint (1000 pages)
            block = _block([(i, "x" * 1000) for i in range(start, start + 500)], start + 500)
            await s.write(partial(crud.add_log_block, run_id="r-1", block=block))
        await asyncio.sleep(0.5)
        grown = (tmp_path / "ew.db").stat().st_size > size + 5_000_000
        assert grown is (checkpoint_s < 1)
    finally:
        await s.close()
