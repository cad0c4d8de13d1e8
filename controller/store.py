"""SQLite store: schema from SQLModel, WAL, ONE writer thread with short batched transactions, pooled readers.

How it works
------------
``write(fn)`` queues ``fn(tx)``; the writer thread takes everything queued (up to a batch), runs each
function inside its own SAVEPOINT within one ``BEGIN IMMEDIATE`` transaction, commits, and only then
resolves the futures and publishes the BusEvents the functions emitted (in commit order).  A failing
function rolls back to its savepoint and gets its exception; the others in the batch still commit.
Readers run ``fn(conn, *args)`` on their own connections in a small thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import create_engine
from sqlmodel import SQLModel

from controller import models
from controller.bus import Bus, BusEvent, make_cursor

log = logging.getLogger(__name__)
T = TypeVar("T")
BATCH_MAX = 512
#: Event kinds the web streams; the others (raw journal records) are kept for the seq ledger only.
FEED_KINDS = frozenset({"run", "milestone", "check", "alert", "log", "host"})
BUSY_TIMEOUT_MS = 30000


def connect(path: Path) -> sqlite3.Connection:
    """A connection with the pragmas every connection needs."""
    conn = sqlite3.connect(
        str(path), isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
    )
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def create_schema(path: Path) -> None:
    """Create the tables (idempotent), switch to WAL, record the schema version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = connect(path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        row = None
        with contextlib.suppress(sqlite3.OperationalError):
            row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
        if row is not None and row[0] is not None and row[0] > models.SCHEMA_VERSION:
            raise RuntimeError(f"database {path} has schema {row[0]}, newer than this controller's")
    finally:
        conn.close()
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
    try:
        SQLModel.metadata.create_all(engine)
    finally:
        engine.dispose()
    conn = connect(path)
    try:
        conn.execute("INSERT OR IGNORE INTO schema_version(version) VALUES (?)", (models.SCHEMA_VERSION,))
    finally:
        conn.close()


class Tx:
    """What a write function gets: the writer's connection and helpers that emit BusEvents after commit."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.events: list[BusEvent] = []
        self.now = time.time()
        self.last_event_id = conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
        self.last_log_id = conn.execute("SELECT coalesce(max(id), 0) FROM log_lines").fetchone()[0]

    def add_event(
        self, run_id: str | None, seq: int | None, kind: str, data: dict[str, Any], at: float
    ) -> bool:
        """Insert an event (ignored when (run, seq) exists); FEED_KINDS are published after commit."""
        cur = self.conn.execute(
            "INSERT OR IGNORE INTO events(run_id, seq, kind, at, data_json, log_mark) VALUES (?,?,?,?,?,?)",
            (run_id, seq, kind, at, json.dumps(data), self.last_log_id),
        )
        if cur.rowcount == 0:
            return False
        self.last_event_id = int(cur.lastrowid or 0)
        if kind in FEED_KINDS:
            cursor = make_cursor(self.last_event_id, self.last_log_id)
            self.events.append(BusEvent(kind, run_id, data, cursor))  # type: ignore[arg-type]
        return True

    def add_log_lines(self, run_id: str, lines: list[list[Any]], next_offset: int | None) -> int:
        """Insert log lines idempotently (unique on run + offset), advance the run's log offset."""
        before = self.last_log_id
        rows = [(run_id, int(o), str(t)) for o, t in lines]
        changes = self.conn.total_changes
        self.conn.executemany("INSERT OR IGNORE INTO log_lines(run_id, offset, text) VALUES (?,?,?)", rows)
        inserted = self.conn.total_changes - changes
        if inserted == len(rows):
            # All new (the usual case): we hold the write lock, so their ids are before+1 … before+n.
            new = [{"offset": r[1], "text": r[2]} for r in rows]
        else:
            got = self.conn.execute(
                "SELECT offset, text FROM log_lines WHERE id > ? AND run_id = ? ORDER BY id", (before, run_id)
            ).fetchall()
            new = [{"offset": r[0], "text": r[1]} for r in got]
        if next_offset is not None:
            self.conn.execute(
                "UPDATE runs SET log_offset = max(log_offset, ?) WHERE id = ?", (int(next_offset), run_id)
            )
        if new:
            self.last_log_id = before + len(new)
            cursor = make_cursor(self.last_event_id, self.last_log_id)
            self.events.append(BusEvent("log", run_id, {"lines": new}, cursor))
        return len(new)

    def run_changed(self, run_id: str) -> None:
        """Record + publish the run's current public shape."""
        from controller.queries import get_run_public

        self.add_event(run_id, None, "run", get_run_public(self.conn, run_id).model_dump(), self.now)

    def host_changed(self, name: str) -> None:
        """Record + publish the host's current public shape."""
        from controller.queries import get_host

        self.add_event(None, None, "host", get_host(self.conn, name).model_dump(), self.now)

    def alert_changed(self, alert_id: int) -> None:
        """Record + publish an alert's current public shape."""
        from controller.queries import get_alert

        alert = get_alert(self.conn, alert_id)
        self.add_event(alert.run_id, None, "alert", alert.model_dump(), self.now)


_Item = tuple[Callable[[Tx], Any], asyncio.Future[Any]]


class Store:
    """The database: one writer thread, reader connections, BusEvents published after commit."""

    def __init__(self, path: Path, bus: Bus | None = None) -> None:
        self.path = Path(path)
        self.bus = bus or Bus()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-read")
        self._local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.pending = 0

    async def open(self) -> None:
        """Create/upgrade the schema and start the writer thread."""
        await asyncio.to_thread(create_schema, self.path)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._writer, name="store-writer", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Finish queued writes, stop the writer, close every connection."""
        if self._thread is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._readers.shutdown(wait=True)
        with self._lock:
            for conn in self._reader_conns:
                conn.close()
            self._reader_conns.clear()

    def submit(self, fn: Callable[[Tx], T]) -> asyncio.Future[T]:
        """Queue a write without waiting; the future resolves after commit."""
        if self._loop is None or self._thread is None:
            raise RuntimeError("store is not open")
        fut: asyncio.Future[T] = self._loop.create_future()
        self.pending += 1
        self._queue.put((fn, fut))
        return fut

    async def write(self, fn: Callable[[Tx], T]) -> T:
        """Run ``fn(tx)`` in the writer's transaction; returns its result after commit."""
        return await self.submit(fn)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` on a reader connection."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._read, fn, args)

    def read_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking read for code already off the event loop."""
        return self._read(fn, args)

    def _read(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path)
            self._local.conn = conn
            with self._lock:
                self._reader_conns.append(conn)
        return fn(conn, *args)

    # ------------------------------------------------------------------ writer thread

    def _writer(self) -> None:
        conn = connect(self.path)
        try:
            stop = False
            while not stop:
                first = self._queue.get()
                if first is None:
                    break
                batch = [first]
                while len(batch) < BATCH_MAX:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        stop = True
                        break
                    batch.append(item)
                self._run_batch(conn, batch)
        finally:
            conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Item]) -> None:
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        events: list[BusEvent] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            tx = Tx(conn)
            for fn, fut in batch:
                mark, ids = len(tx.events), (tx.last_event_id, tx.last_log_id)
                conn.execute("SAVEPOINT op")
                try:
                    res = fn(tx)
                except Exception as exc:  # handed to the caller's future
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    del tx.events[mark:]
                    tx.last_event_id, tx.last_log_id = ids
                    results.append((fut, None, exc))
                else:
                    conn.execute("RELEASE op")
                    results.append((fut, res, None))
            conn.execute("COMMIT")
            events = tx.events
        except Exception as exc:
            log.exception("store: batch of %d writes failed", len(batch))
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            results = [(fut, None, exc) for _, fut in batch]
            events = []
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            self._loop.call_soon_threadsafe(self._deliver, results, events)

    def _deliver(
        self, results: list[tuple[asyncio.Future[Any], Any, BaseException | None]], events: list[BusEvent]
    ) -> None:
        for event in events:
            self.bus.publish(event)
        for fut, res, exc in results:
            self.pending -= 1
            if fut.done():
                continue
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(res)
