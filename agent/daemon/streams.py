"""Streams for one ``follow``: journal events after a seq, and complete log lines from a byte offset."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from agent import protocol
from agent.logs.splitter import LineSplitter
from agent.runs.journal import read_events
from agent.runs.watcher import RunWatcher

Send = Callable[[dict[str, Any]], Awaitable[None]]
#: A log batch holds at most this many lines or about this many bytes of text.
BATCH_LINES = 500
BATCH_BYTES = 64 * 1024
READ_CHUNK = 1 << 20
#: Safety net in case a wake-up is missed (e.g. a log written while no watcher runs).
RECHECK_S = 5.0


async def stream_events(send: Send, watcher: RunWatcher, after_seq: int) -> None:
    """Send every journal event with seq > ``after_seq``, backlog first then live, in order, once each."""
    pos = after_seq
    offset = 0
    run = watcher.paths.run
    while True:
        generation = watcher.events_changed.generation
        events, offset = read_events(watcher.paths.events, offset)
        for ev in events:
            seq = ev.get("seq")
            if isinstance(seq, int) and seq > pos:
                await send(protocol.event(run, ev))
                pos = seq
        await watcher.events_changed.wait_past(generation, RECHECK_S)


async def stream_log(send: Send, watcher: RunWatcher, log_offset: int) -> None:
    """Send complete log lines from stream offset ``log_offset`` on, split exactly as the watcher splits them.

    Offsets run on across truncations and replacements of output.log (agent/logs/generations.py): where a
    generation ends, its unterminated last line is sent as a line, as the watcher ends it.
    """
    run = watcher.paths.run
    splitter = LineSplitter(start_offset=log_offset)
    fed = log_offset
    flushed_at = -1
    while True:
        generation = watcher.log_changed.generation
        chunk = watcher.chain.read_at(fed, READ_CHUNK)
        if chunk.jumped:
            await _send_lines(send, run, [(ln.offset, ln.text) for ln in splitter.flush()], chunk.offset)
            splitter = LineSplitter(start_offset=chunk.offset)
            fed = chunk.offset
        if chunk.data:
            fed += len(chunk.data)
            await _send_lines(
                send, run, [(ln.offset, ln.text) for ln in splitter.feed(chunk.data)], splitter.pending_offset
            )
            continue  # read on until the end: a full chunk or a seam may be followed by more
        if chunk.at_end and watcher.summary.terminal is not None and flushed_at != fed:
            # The job has ended: its unterminated last line is a line now.
            flushed_at = fed
            await _send_lines(
                send, run, [(ln.offset, ln.text) for ln in splitter.flush()], splitter.pending_offset
            )
        await watcher.log_changed.wait_past(generation, RECHECK_S)


async def _send_lines(send: Send, run: str, lines: list[tuple[int, str]], end_offset: int) -> None:
    """Send ``lines`` in batches; each batch's next_offset is where the following unsent line starts."""
    batch: list[tuple[int, str]] = []
    size = 0
    for i, (offset, text) in enumerate(lines):
        batch.append((offset, text))
        size += len(text) + 16
        if len(batch) >= BATCH_LINES or size >= BATCH_BYTES:
            nxt = lines[i + 1][0] if i + 1 < len(lines) else end_offset
            await send(protocol.log_lines(run, batch, nxt))
            batch, size = [], 0
    if batch:
        await send(protocol.log_lines(run, batch, end_offset))
