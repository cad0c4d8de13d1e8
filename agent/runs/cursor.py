"""The watcher's cursor: where it stands in the log, written only once the journal durably holds its seq.

The cursor (log offset, line number, engine snapshot, journal seq, checked files, log generations) lets a
restarted watcher resume with nothing lost and nothing twice (watcher.py).  It is written after the journal
fsync that covers its seq: at once for a forced save, or, while the watcher reads on, after an fsync that
runs in a worker thread (``sync_behind``), as it stood when that fsync began.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.paths import atomic_write_json
from agent.runs.journal import Journal

log = logging.getLogger("eaglewatch.agent")
CURSOR_EVERY_S = 0.5


class Cursor:
    """Writes the cursor file ``path``: ``state()`` (where the watcher stands) with the journal's seq, after
    ``commit(sync)`` has written the events queued before it."""

    def __init__(
        self,
        path: Path,
        journal: Journal,
        commit: Callable[[bool], None],
        state: Callable[[], dict[str, Any]],
    ) -> None:
        self.path = path
        self.journal = journal
        self._commit = commit
        self._state = state
        self._at = 0.0  # when the cursor was last written
        self._version = 0  # bumped by every write
        self._syncing: asyncio.Future[None] | None = None  # a journal fsync in a worker thread

    def _now(self) -> dict[str, Any]:
        return {**self._state(), "seq": self.journal.last_seq}

    def save(self, force: bool = False) -> None:
        """Commit (fsynced), then (at most every CURSOR_EVERY_S unless forced) write the cursor."""
        self._commit(True)
        if force or time.monotonic() - self._at >= CURSOR_EVERY_S:
            self._write(self._now())

    def _write(self, state: dict[str, Any]) -> None:
        """Write ``state`` as the cursor (it supersedes any cursor an fsync in flight would write)."""
        self._at = time.monotonic()
        self._version += 1
        atomic_write_json(self.path, state, fsync=False)

    def sync_behind(self) -> None:
        """Commit, and fsync the journal in a worker thread while the watcher reads and splits on; once the
        fsync is done, write the cursor as it stood when the fsync began (if one is due and no later
        cursor was written meanwhile): the cursor never points past what the journal holds durably."""
        self._commit(False)
        if self._syncing is not None and not self._syncing.done():
            return  # one fsync at a time: the next one covers what is written meanwhile
        due = time.monotonic() - self._at >= CURSOR_EVERY_S
        if not self.journal.unsynced:
            if due:
                self._write(self._now())
            return
        # A deep copy: the engine's open groups and the checked files move on while the disk syncs.
        state = copy.deepcopy(self._now()) if due else None
        version = self._version
        fut = asyncio.get_running_loop().run_in_executor(None, self.journal.sync)
        self._syncing = fut

        def synced(done: asyncio.Future[None]) -> None:
            if done.cancelled() or done.exception() is not None:
                if not done.cancelled():
                    log.warning("journal %s: fsync failed: %s", self.journal.path, done.exception())
                return
            if state is not None and self._version == version:
                with contextlib.suppress(OSError):
                    self._write(state)

        fut.add_done_callback(synced)

    async def synced(self) -> None:
        """Wait for the fsync in flight, if any (before the journal is closed)."""
        if self._syncing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._syncing)
            self._syncing = None
