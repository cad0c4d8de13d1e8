"""EventQueue: a link's journal events waiting for the store's writer, taken all at once by one write.

How it works
------------
The link's reader ``put``s each event as it arrives (event loop); only the first event after a ``take``
asks the caller to submit a write, and that write, run later by the writer thread, ``take``s everything
queued by then.  So while the writer is busy, events pile up here and go into the database in one
transaction (the run row read once per batch, crud.apply_event_batch) instead of one write each.
No event is left behind: ``put`` appends before it looks at the flag and ``take`` clears the flag before
it drains, so an event either is drained by a queued write or sees the flag clear and submits one (deque
appends and pops, and single attribute reads and writes, are atomic under the GIL).
Once ``broken`` (a batch failed to commit), the queue takes and keeps nothing: the caller reconnects and
the agent replays every event after the stored last_seq, so nothing is lost or applied twice.
"""

from __future__ import annotations

from collections import deque
from typing import Any

Item = tuple[str, dict[str, Any]]


class EventQueue:
    """Journal events (run id, event) of one link, in arrival order."""

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._queued = False
        self.broken = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, run_id: str, event: dict[str, Any]) -> bool:
        """Queue an event; True when the caller must submit a write that will ``take``."""
        if self.broken:
            return False
        self._items.append((run_id, event))
        if self._queued:
            return False
        self._queued = True
        return True

    def take(self) -> list[Item]:
        """Everything queued, oldest first (called by the write, in the writer thread)."""
        self._queued = False
        if self.broken:
            return []
        out: list[Item] = []
        pop = self._items.popleft
        while True:
            try:
                out.append(pop())
            except IndexError:
                return out

    def fail(self) -> None:
        """A batch was not stored: take nothing more (the caller reconnects; the agent replays)."""
        self.broken = True
        self._items.clear()
