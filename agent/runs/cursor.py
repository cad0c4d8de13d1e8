"""The watcher's cursor: where it stands in the log, saved only once the journal holds what it points to.

The cursor (log offset, line number, engine snapshot, journal seq, checked files, log generations) lets a
restarted watcher resume with nothing lost and nothing twice (watcher.py).  It is written after the journal
fsync that covers its seq: at once for a forced save, or, while the watcher reads on, after an fsync that
runs in a worker thread (``_sync_behind``), as it stood when that fsync began.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from typing import Any

from agent.logs.generations import LogChain
from agent.logs.splitter import LineSplitter
from agent.milestones.engine import MilestoneEngine
from agent.paths import RunPaths, atomic_write_json
from agent.runs.classifier import RemoteEngine
from agent.runs.journal import Journal

log = logging.getLogger("eaglewatch.agent")
CURSOR_EVERY_S = 0.5


class CursorKeeper:
    """Mixed into RunWatcher: saving its cursor, and the journal fsyncs it waits for."""

    paths: RunPaths
    journal: Journal
    splitter: LineSplitter
    engine: MilestoneEngine | RemoteEngine
    chain: LogChain
    line: int
    checked: dict[str, list[int]]
    _cursor_at: float
    _cursor_version: int  # bumped by every cursor write
    _syncing: asyncio.Future[None] | None  # a journal fsync in a worker thread

    def _commit(self, sync: bool = True) -> None:
        raise NotImplementedError

    def _catch_up(self) -> None:
        raise NotImplementedError

    def _save_cursor(self, force: bool = False) -> None:
        """Commit pending events, then (at most every CURSOR_EVERY_S unless forced) write the cursor."""
        self._catch_up()
        self._commit()
        now = time.monotonic()
        if not force and now - self._cursor_at < CURSOR_EVERY_S:
            return
        self._write_cursor(self._cursor_state())

    def _cursor_state(self) -> dict[str, Any]:
        """Where the watcher stands: the journal's last seq and what regenerates the events after it."""
        return {
            "offset": self.splitter.pending_offset,
            "line": self.line,
            "seq": self.journal.last_seq,
            "engine": self.engine.snapshot(),
            "checked": self.checked,
            "log": self.chain.snapshot(),
        }

    def _write_cursor(self, state: dict[str, Any]) -> None:
        """Write ``state`` as the cursor (it supersedes any cursor an fsync in flight would write)."""
        self._cursor_at = time.monotonic()
        self._cursor_version += 1
        atomic_write_json(self.paths.cursor, state, fsync=False)

    def _sync_behind(self) -> None:
        """Commit, and fsync the journal in a worker thread while the watcher reads and splits on; once the
        fsync is done, write the cursor as it stood when the fsync began (if one is due and no later
        cursor was written meanwhile): the cursor never points past what the journal holds durably."""
        self._commit(sync=False)
        if self._syncing is not None and not self._syncing.done():
            return  # one fsync at a time: the next one covers what is written meanwhile
        due = time.monotonic() - self._cursor_at >= CURSOR_EVERY_S
        engine = self.engine
        if due and isinstance(engine, RemoteEngine) and engine.outstanding:
            # The classifier child is still on earlier blocks: ask for its snapshot in line with them
            # rather than wait; the cursor follows from _snapshot_reached.
            # The fsync waits for it too: one started now would still run when the snapshot comes back.
            if not engine.snapshot_pending:  # the engine adds the line number it has reached there
                at = {"offset": self.splitter.pending_offset, "log": self.chain.snapshot()}
                engine.request_snapshot(at)
            return
        if not self.journal.unsynced:
            if due:
                self._write_cursor(self._cursor_state())
            return
        # A deep copy: the engine's open groups and the checked files move on while the disk syncs.
        self._sync_then_write(copy.deepcopy(self._cursor_state()) if due else None)

    def _snapshot_reached(self, context: dict[str, Any], snapshot: dict[str, Any]) -> None:
        """The classifier child's snapshot at a point of the log: every milestone before it is journaled
        now, so the cursor there is the state kept when it was asked for, with the journal's seq now."""
        self._commit(sync=False)
        if self._syncing is not None and not self._syncing.done():
            return  # a later _sync_behind asks again
        state = {**context, "seq": self.journal.last_seq, "engine": snapshot}
        state["checked"] = copy.deepcopy(self.checked)
        if self.journal.unsynced:
            self._sync_then_write(state)
        else:
            self._write_cursor(state)

    def _sync_then_write(self, state: dict[str, Any] | None) -> None:
        """fsync the journal in a worker thread, then write ``state`` as the cursor (unless None, or a
        later cursor was written meanwhile)."""
        version = self._cursor_version
        fut = asyncio.get_running_loop().run_in_executor(None, self.journal.sync)
        self._syncing = fut

        def synced(done: asyncio.Future[None]) -> None:
            if done.cancelled() or done.exception() is not None:
                if not done.cancelled():
                    log.warning("run %s: journal fsync failed: %s", self.paths.run, done.exception())
                return
            if state is not None and self._cursor_version == version:
                with contextlib.suppress(OSError):
                    self._write_cursor(state)

        fut.add_done_callback(synced)

    async def _synced(self) -> None:
        """Wait for the fsync in flight, if any (before the journal is closed)."""
        if self._syncing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._syncing)
            self._syncing = None
