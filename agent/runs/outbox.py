"""The watcher's outbox: events on their way to the run's journal, each written once across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.logs.tail import Broadcast
from agent.paths import atomic_write_json
from agent.runs.journal import Journal
from agent.runs.summary import RunSummary

log = logging.getLogger("eaglewatch.agent")
CURSOR_EVERY_S = 0.5


def _milestone_key(ev: dict[str, Any]) -> tuple[Any, ...]:
    return (ev.get("kind"), ev.get("line"), ev.get("rank"), ev.get("text"))


class Outbox:
    """Queues events and writes them to ``journal`` a batch at a time (into ``summary``, waking ``written``);
    writes ``state()`` with the journal's seq as the cursor only once the journal durably holds that seq.

    A restarted watcher regenerates the milestones journaled after the cursor: ``skip_journaled`` learns
    them, and each is dropped once when it comes again (taken into the summary, not written)."""

    def __init__(
        self,
        journal: Journal,
        summary: RunSummary,
        written: Broadcast,
        cursor: Path,
        state: Callable[[], dict[str, Any]],
    ) -> None:
        self.journal = journal
        self.summary = summary
        self._written = written
        self._queue: list[dict[str, Any]] = []
        self._skip: Counter[tuple[Any, ...]] = Counter()
        self._cursor = cursor
        self._state = state
        self._at = 0.0  # when the cursor was last written
        self._version = 0  # bumped by every cursor write
        self._syncing: asyncio.Future[None] | None = None  # a journal fsync in a worker thread

    def skip_journaled(self, journaled: list[dict[str, Any]], after_seq: int) -> set[str]:
        """Learn the milestones ``journaled`` past ``after_seq`` (the cursor's); return the files whose checks
        are journaled there (not checked again)."""
        checked: set[str] = set()
        for ev in journaled:
            if int(ev.get("seq", 0)) <= after_seq:
                continue
            if ev.get("type") == "milestone":
                self._skip[_milestone_key(ev)] += 1
            elif ev.get("type") == "check":
                checked.add(str(ev.get("file")))
        return checked

    def add(self, events: list[dict[str, Any]]) -> None:
        """Queue ``events`` for the journal, but for milestones it already holds from before a crash."""
        if not self._skip:
            self._queue += events
            return
        for ev in events:
            if ev.get("type") == "milestone":
                key = _milestone_key(ev)
                if self._skip[key] > 0:
                    self._skip[key] -= 1
                    if not self._skip[key]:
                        del self._skip[key]  # an empty Counter lets the next batches through unlooked
                    self.summary.observe(ev)
                    continue
            self._queue.append(ev)

    def commit(self, sync: bool = True) -> None:
        """Write the queued events (one write; one fsync unless ``sync`` is False: then ``journal.sync()``
        later), take them into the summary and wake the followers."""
        if not self._queue:
            if sync:
                self.journal.sync()
            return
        events, self._queue = self._queue, []
        observe = self.summary.observe
        for ev in self.journal.append_many(events, sync=sync):
            observe(ev)
        self._written.notify()

    def _now(self) -> dict[str, Any]:
        return {**self._state(), "seq": self.journal.last_seq}

    def save(self, force: bool = False) -> None:
        """Commit (fsynced), then (at most every CURSOR_EVERY_S unless forced) write the cursor."""
        self.commit(True)
        if force or time.monotonic() - self._at >= CURSOR_EVERY_S:
            self._write(self._now())

    def _write(self, state: dict[str, Any]) -> None:
        """Write ``state`` as the cursor (it supersedes any cursor an fsync in flight would write)."""
        self._at = time.monotonic()
        self._version += 1
        atomic_write_json(self._cursor, state, fsync=False)

    def sync_behind(self) -> None:
        """Commit, and fsync the journal in a worker thread while the watcher reads and splits on; once the
        fsync is done, write the cursor as it stood when the fsync began (if one is due and no later
        cursor was written meanwhile): the cursor never points past what the journal holds durably."""
        self.commit(False)
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
