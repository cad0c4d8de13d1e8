"""In-process pub/sub: committed items fan out to subscribers (the web's SSE streams).

Every BusEvent is published only after its row is committed, and carries a ``cursor`` that
``Controller.feed_since`` understands, so a subscriber that lagged or reconnected re-reads from SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

BusKind = Literal["run", "milestone", "check", "alert", "log", "host"]


def make_cursor(event_id: int, log_id: int) -> str:
    """Cursor string for a position: (last events.id, last log_blocks.id); ordered as strings."""
    return f"{event_id:012d}-{log_id:012d}"


def parse_cursor(cursor: str | None) -> tuple[int, int]:
    """Inverse of make_cursor; None or '' means the beginning; raises ValueError when malformed."""
    if not cursor:
        return (0, 0)
    left, sep, right = cursor.partition("-")
    if not sep or not left.isdigit() or not right.isdigit():
        raise ValueError(f"malformed cursor {cursor[:40]!r}")
    return (int(left), int(right))


@dataclass(frozen=True)
class BusEvent:
    """One committed item: a run change, milestone, check, alert, block of log lines or host change."""

    kind: BusKind
    run_id: str | None
    data: dict[str, Any] = field(default_factory=dict)
    cursor: str = ""


class Subscription:
    """A subscriber's queue; iterate it. Ends (StopAsyncIteration) if it lags more than ``maxsize``."""

    def __init__(self, bus: Bus, maxsize: int) -> None:
        self._bus = bus
        self._queue: asyncio.Queue[BusEvent | None] = asyncio.Queue(maxsize)
        self.lagged = False

    def _put(self, event: BusEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            # A slow reader is cut off rather than growing memory; it resumes with feed_since(cursor).
            self.lagged = True
            self._bus._drop(self)
            with contextlib.suppress(asyncio.QueueEmpty):
                self._queue.get_nowait()
            self._queue.put_nowait(None)

    def close(self) -> None:
        """Stop receiving events; a pending iteration ends."""
        self._bus._drop(self)
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[BusEvent]:
        return self

    async def __anext__(self) -> BusEvent:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item


class Bus:
    """Fan-out of BusEvents to every current subscriber."""

    def __init__(self, maxsize: int = 10000) -> None:
        self._subs: list[Subscription] = []
        self._maxsize = maxsize

    def subscribe(self) -> Subscription:
        """A new subscription receiving every event published from now on."""
        sub = Subscription(self, self._maxsize)
        self._subs.append(sub)
        return sub

    def publish(self, event: BusEvent) -> None:
        """Deliver to all subscribers (non-blocking)."""
        for sub in list(self._subs):
            sub._put(event)

    def close(self) -> None:
        """End every subscription (controller shutdown)."""
        for sub in list(self._subs):
            sub.close()

    def _drop(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
