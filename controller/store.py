"""SQLite store: schema from SQLModel, WAL, ONE writer thread with short batched transactions, pooled readers.

How it works
------------
``write(fn)`` queues ``fn(tx=tx)`` (in practice a data function of controller/crud.py); the writer thread
takes everything queued (up to a batch), runs each function inside its own SAVEPOINT within one
``BEGIN IMMEDIATE`` transaction, commits, and only then resolves the futures and publishes the BusEvents
the functions emitted (in commit order).  A failing function rolls back to its savepoint and gets its
exception; the others in the batch still commit.
A short write asked for ``now_if_idle`` (a log block or events from a link) skips the queue while the writer
is idle: it runs on the event loop's thread, on the writer's own connection (lent under a lock, so still one
writer), ``SOON_S`` after the first of them (a milestone: at the end of the loop's round), in one
transaction with every other such write that came in meanwhile (the links' blocks of those milliseconds: one
commit, not one each); the hand-over to the writer thread and the call back to the loop were two thread
wake-ups on every line's way to its commit.
The writer never checkpoints the WAL itself: a checkpoint fsyncs the database file, tens of milliseconds on
the commit path of whatever line or milestone waits behind it.  A thread of its own checkpoints
(PASSIVE: it never blocks the writer) every ``CHECKPOINT_S``.
Readers run ``fn(conn, *args)`` on their own connections in a small thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy import create_engine
from sqlalchemy.dialects import sqlite
from sqlmodel import SQLModel

from controller import models
from controller.bus import Bus, BusEvent

log = logging.getLogger(__name__)
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
BATCH_MAX = 512
#: Event kinds the web streams; the others (raw journal records) are kept for the seq ledger only.
FEED_KINDS = frozenset({"run", "milestone", "check", "alert", "log", "host"})
BUSY_TIMEOUT_MS = 30000
CHECKPOINT_S = 1.0
#: How long a ``now_if_idle`` write waits for others to share its commit: at 8 hosts x 8 runs this alone
#: took the controller from 0.35 to 0.28 cores (docs/benchmarks.md, Fleet).
SOON_S = 0.01


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


def make_private(path: Path) -> None:
    """Create the database file 0600 before SQLite does (it would use the umask, often 0644) and tighten
    an existing one and its -wal/-shm files: launched specs keep their environment, secrets included."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if p.stat().st_mode & 0o077 and p.stat().st_uid == os.getuid():
                p.chmod(0o600)


def create_schema(path: Path) -> None:
    """Create the tables (idempotent), switch to WAL, record the schema version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    make_private(path)
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
        _add_missing_columns(conn)
        conn.execute("INSERT OR IGNORE INTO schema_version(version) VALUES (?)", (models.SCHEMA_VERSION,))
    finally:
        conn.close()


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """create_all makes missing tables only; a database from before a (nullable) column was added gets it
    here, typed as the table model says."""
    for table in SQLModel.metadata.sorted_tables:
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table.name})")}
        for col in table.columns:
            if col.name not in have:
                sql_type = col.type.compile(dialect=sqlite.dialect())
                conn.execute(f"ALTER TABLE {table.name} ADD COLUMN {col.name} {sql_type}")


class Tx:
    """What a write function gets: the writer's connection, the BusEvents to publish after commit, and the
    last event and log-block ids (their cursor; controller/crud.py keeps them current)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.events: list[BusEvent] = []
        self.now = time.time()
        self.last_event_id = conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
        self.last_log_id = conn.execute("SELECT coalesce(max(id), 0) FROM log_blocks").fetchone()[0]


class WriteFn(Protocol[T_co]):
    """A write: called with the transaction as ``tx=`` (crud's data functions take it keyword-only)."""

    def __call__(self, *, tx: Tx) -> T_co:
        """Do the write inside the writer's transaction."""
        ...


_Item = tuple[WriteFn[Any], asyncio.Future[Any]]


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
        self._checkpoints: threading.Thread | None = None
        self._closing = threading.Event()
        #: the writer's connection: the writer thread's, lent to ``_write_now`` while that thread is idle
        self._conn: sqlite3.Connection | None = None
        self._conn_lock = threading.Lock()
        self.pending = 0
        #: ``now_if_idle`` writes waiting for their shared commit (SOON_S after the first of them)
        self._soon: list[_Item] = []

    async def open(self) -> None:
        """Create/upgrade the schema and start the writer thread."""
        await asyncio.to_thread(create_schema, self.path)
        self._loop = asyncio.get_running_loop()
        self._conn = connect(self.path)
        # The checkpointer thread checkpoints, off the commit path.
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        self._thread = threading.Thread(target=self._writer, name="store-writer", daemon=True)
        self._thread.start()
        self._closing.clear()
        self._checkpoints = threading.Thread(target=self._checkpointer, name="store-checkpoint", daemon=True)
        self._checkpoints.start()

    async def close(self) -> None:
        """Finish queued writes, stop the writer, close every connection."""
        if self._thread is not None:
            self._queue_soon()
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._checkpoints is not None:
            self._closing.set()
            await asyncio.to_thread(self._checkpoints.join)
            self._checkpoints = None
        self._readers.shutdown(wait=True)
        with self._lock:
            for conn in self._reader_conns:
                conn.close()
            self._reader_conns.clear()

    def submit(
        self, fn: WriteFn[T], *, now_if_idle: bool = False, at_once: bool = False
    ) -> asyncio.Future[T]:
        """Queue a write without waiting; the future resolves after commit.  ``now_if_idle`` (a log block):
        run on this thread ``SOON_S`` later with the other such writes if the writer is idle then (see the
        module docstring); ``at_once`` (a milestone, which a user waits for): at the end of this loop turn."""
        if self._loop is None or self._thread is None:
            raise RuntimeError("store is not open")
        fut: asyncio.Future[T] = self._loop.create_future()
        if now_if_idle:
            self._soon.append((fn, fut))
            if at_once:
                self._loop.call_soon(self._write_soon)
            elif len(self._soon) == 1:
                self._loop.call_later(SOON_S, self._write_soon)
            return fut
        self._queue_soon()  # the waiting writes go first: writes commit in the order submitted
        self.pending += 1
        self._queue.put((fn, fut))
        return fut

    def _write_soon(self) -> None:
        """Commit the waiting ``now_if_idle`` writes at once if the writer is idle, else queue them."""
        batch, self._soon = self._soon, []
        if batch and not self._write_now(batch):
            self._enqueue(batch)

    def _queue_soon(self) -> None:
        batch, self._soon = self._soon, []
        self._enqueue(batch)

    def _enqueue(self, batch: list[_Item]) -> None:
        self.pending += len(batch)
        for item in batch:
            self._queue.put(item)

    async def write(self, fn: WriteFn[T]) -> T:
        """Run ``fn(tx=tx)`` in the writer's transaction; returns its result after commit."""
        return await self.submit(fn)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` on a reader connection."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._read, fn, args)

    def _read(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path)
            self._local.conn = conn
            with self._lock:
                self._reader_conns.append(conn)
        return fn(conn, *args)

    async def vacuum(self) -> None:
        """Give the pages freed by deletes back to the filesystem (``VACUUM``, on the writer's connection
        while it holds no transaction: still one writer; writes wait meanwhile)."""

        def run() -> None:
            with self._conn_lock:
                conn = self._conn
                if conn is None:
                    raise RuntimeError("the store is not open")
                conn.execute("VACUUM")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

        await asyncio.to_thread(run)

    # ------------------------------------------------------------------ writer thread

    def _checkpointer(self) -> None:
        conn = connect(self.path)
        try:
            while not self._closing.wait(CHECKPOINT_S):
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            with contextlib.suppress(sqlite3.Error):  # the writer has stopped: leave a short WAL behind
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            conn.close()

    def _writer(self) -> None:
        conn = self._conn
        assert conn is not None
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
                with self._conn_lock:
                    results, events = self._transact(conn, batch)
                assert self._loop is not None
                with contextlib.suppress(RuntimeError):  # loop closed during shutdown
                    self._loop.call_soon_threadsafe(self._deliver, results, events)
        finally:
            with self._conn_lock:
                self._conn = None
                conn.close()

    def _write_now(self, batch: list[_Item]) -> bool:
        """Run ``batch`` at once on the event loop's thread, on the writer's connection, if the writer is
        idle (nothing queued, and no other process holds SQLite's write lock); False when it is not."""
        conn = self._conn
        if self.pending or conn is None or not self._conn_lock.acquire(blocking=False):
            return False
        try:
            if self._conn is None:
                return False
            conn.execute("PRAGMA busy_timeout=0")
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:  # another process is writing: wait in the queue instead
                return False
            finally:
                conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            results, events = self._transact(conn, batch, begun=True)
        finally:
            self._conn_lock.release()
        self.pending += len(batch)
        self._deliver(results, events)
        return True

    def _transact(
        self, conn: sqlite3.Connection, batch: list[_Item], begun: bool = False
    ) -> tuple[list[tuple[asyncio.Future[Any], Any, BaseException | None]], list[BusEvent]]:
        """Run ``batch`` in one transaction (a savepoint per write); the results and the events to publish."""
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        events: list[BusEvent] = []
        try:
            if not begun:
                conn.execute("BEGIN IMMEDIATE")
            tx = Tx(conn)
            for fn, fut in batch:
                mark, ids = len(tx.events), (tx.last_event_id, tx.last_log_id)
                conn.execute("SAVEPOINT op")
                try:
                    res = fn(tx=tx)
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
        return results, events

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
