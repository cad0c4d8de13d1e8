"""Server-Sent Events: BusEvent → SSE formatting and the resumable stream behind the events endpoints.

Each event's SSE ``id`` is its bus cursor (cursors order as strings). A client resumes from the last one it
saw (``Last-Event-ID`` on reconnects, ``?after=`` from a page rendered at that cursor). The stream
subscribes to the bus *first*, then replays ``feed_since(cursor)`` from SQLite, then forwards live events
newer than the last one sent: nothing missed in the gap, nothing sent twice. Host events have no cursor:
they are forwarded live, without an ``id``. Events are written to the socket by the one task that waits on
the bus (no relay tasks); ``: ping`` every ``PING_S`` of silence keeps proxies open and notices a client
that left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi.sse import ServerSentEvent, format_sse_event
from starlette.responses import StreamingResponse

from controller.bus import BusEvent
from controller.errors import NotFound
from controller.service import Controller

TERMINAL_STATES = frozenset({"completed", "failed", "stopped", "lost"})
RETRY_MS = 1500
BACKLOG_PAGE = 1000
#: The dashboard's feed leaves out log lines and milestones (the run rows carry the last milestone).
DASHBOARD_KINDS = frozenset({"run", "alert", "host"})
#: Seconds of silence before a keep-alive comment.
PING_S = 15.0
PING = ServerSentEvent(comment="ping")


def to_sse(event: BusEvent) -> ServerSentEvent:
    """The SSE form of one bus event: ``event:`` = kind, ``data:`` = JSON, ``id:`` = cursor; a ``log`` event
    carries its stored block, ``{"offset", "next_offset", "text", "offsets"?}`` (``text`` the lines joined
    by ``\n``; ``offsets`` only where they are not the natural ones: agent/protocol.py ``natural_offsets``),
    one JSON string per block rather than an object per line, so a busy log stays cheap to send."""
    data = event.data
    if event.kind == "log":
        data = {k: v for k, v in event.data.items() if k != "offsets" or v is not None}
    payload = {"run_id": event.run_id, "cursor": event.cursor, **data}
    return ServerSentEvent(data=payload, event=event.kind, id=event.cursor or None)


def encode(sse: ServerSentEvent) -> bytes:
    """Wire bytes of one ServerSentEvent (the same encoding FastAPI applies when streaming)."""
    data = json.dumps(sse.data, separators=(",", ":"), default=str) if sse.data is not None else sse.raw_data
    return format_sse_event(data_str=data, event=sse.event, id=sse.id, retry=sse.retry, comment=sse.comment)


def wanted(
    event: BusEvent, run_id: str | None, host: str | None, kinds: frozenset[str] | None = None
) -> bool:
    """Whether a stream for ``run_id`` (None: every run) and its ``host`` forwards ``event``."""
    if kinds is not None and event.kind not in kinds:
        return False
    if run_id is None:
        return True
    if event.kind == "host":
        return host is not None and event.data.get("name") == host
    return event.run_id == run_id


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response (and what the OpenAPI document says the events endpoints return)."""

    media_type = "text/event-stream"


def response(events: AsyncGenerator[ServerSentEvent, None]) -> SSEResponse:
    """The HTTP response streaming ``events`` as SSE bytes (the generator is closed when the client goes)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for sse in events:
                yield encode(sse)
        finally:
            await events.aclose()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return SSEResponse(body(), headers=headers)


def end_event(state: str) -> ServerSentEvent:
    """Sent once a finished run's backlog is complete; the page closes its EventSource on it."""
    return ServerSentEvent(data={"state": state}, event="end")


async def event_stream(
    controller: Controller,
    run_id: str | None,
    cursor: str | None,
    *,
    host: str | None = None,
    kinds: frozenset[str] | None = None,
    from_now: bool = False,
) -> AsyncGenerator[ServerSentEvent, None]:
    """Backlog since ``cursor`` then live events; ends after the backlog when the run already finished."""
    last = cursor or ""
    yield ServerSentEvent(retry=RETRY_MS, comment="eaglewatch")
    while True:
        sub = controller.bus.subscribe()
        try:
            while not from_now:
                backlog = await controller.feed_since(run_id, last or None, limit=BACKLOG_PAGE)
                fresh = [ev for ev in backlog if ev.cursor > last]
                for ev in fresh:
                    if wanted(ev, run_id, host, kinds):
                        yield to_sse(ev)
                    last = max(last, ev.cursor)
                if not fresh:  # a short page is not the end: a page of big log blocks is cut by size
                    break
            if run_id is not None:
                with contextlib.suppress(NotFound):
                    state = (await controller.get_run(run_id)).state
                    if state in TERMINAL_STATES:
                        yield end_event(state)
                        return
            from_now = False  # after a lag, resume from the last cursor sent
            while True:
                try:
                    async with asyncio.timeout(PING_S):
                        ev = await anext(sub)
                except TimeoutError:
                    yield PING
                    continue
                except StopAsyncIteration:
                    break
                if not wanted(ev, run_id, host, kinds):
                    continue
                if ev.cursor:
                    if ev.cursor <= last:
                        continue
                    last = ev.cursor
                yield to_sse(ev)
            if not sub.lagged:
                return  # the bus closed: the controller is shutting down
        finally:
            sub.close()
