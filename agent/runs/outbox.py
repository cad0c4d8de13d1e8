"""The watcher's outbox: events on their way to the run's journal, each written once across a restart."""

from __future__ import annotations

from collections import Counter
from typing import Any

from agent.logs.tail import Broadcast
from agent.runs.journal import Journal, scan
from agent.runs.summary import RunSummary


def _milestone_key(ev: dict[str, Any]) -> tuple[Any, ...]:
    return (ev.get("kind"), ev.get("line"), ev.get("rank"), ev.get("text"))


class Outbox:
    """Queues events and writes them to ``journal`` a batch at a time; each written event goes into
    ``summary`` and every batch wakes ``written`` (the run's event followers).

    A restarted watcher regenerates the milestones journaled after its cursor: ``skip_journaled`` learns
    them, and each is dropped once when it comes again (taken into the summary, not written)."""

    def __init__(self, journal: Journal, summary: RunSummary, written: Broadcast) -> None:
        self.journal = journal
        self.summary = summary
        self._written = written
        self._queue: list[dict[str, Any]] = []
        self._skip: Counter[tuple[Any, ...]] = Counter()

    def skip_journaled(self, after_seq: int) -> set[str]:
        """Learn the milestones journaled past ``after_seq`` (the cursor's); return the files whose checks
        are journaled there (not checked again)."""
        checked: set[str] = set()
        for ev in scan(self.journal.path):
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
