"""Streams for one ``follow``: journal events after a seq, and complete log lines from a byte offset."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from agent import protocol
from agent.logs.splitter import Line, LineSplitter
from agent.runs.journal import read_raw
from agent.runs.watcher import RunWatcher

Send = Callable[[dict[str, Any]], Awaitable[None]]
SendBytes = Callable[[bytes], Awaitable[None]]
#: Events found by one read go out in writes of about this many bytes (the writer's buffer stays bounded).
EVENT_WRITE_BYTES = 256 * 1024
#: A log block (one string for all its lines: no per-line cost on the wire or in the store) holds at most
#: this many lines or about this many bytes of text.
BLOCK_LINES = 8192
BLOCK_BYTES = 512 * 1024
READ_CHUNK = 1 << 20
#: Safety net in case a wake-up is missed (e.g. a log written while no watcher runs).
RECHECK_S = 5.0
#: A live log's lines go out at most this often per follower: a job logging 50 lines a second sends blocks of
#: a few lines, not one each, and every block costs the controller a message and a commit (tests/bench/
#: bench_fleet.py). Milestones do not wait for it: they stream apart (stream_events).
LOG_SEND_GAP_S = 0.1


async def stream_events(send_bytes: SendBytes, watcher: RunWatcher, after_seq: int) -> None:
    """Send every journal event with seq > ``after_seq``, backlog first then live, in order, once each.

    The journal's lines are strict JSON already: each goes out framed as it is (``protocol.event_frames``),
    found by its seq without being decoded, and all that one read found in a few writes, not one a line.
    A follower that has caught up takes the new lines from the journal's memory (``Journal.recent``), not
    from the file, framed all at once.
    """
    pos = after_seq
    offset = 0
    run = watcher.paths.run
    while True:
        generation = watcher.events_changed.generation
        recent = watcher.journal.recent.after(pos, offset)
        if recent is not None:
            lines, offset = recent
            if lines:
                pos = watcher.journal.last_seq
                await send_bytes(protocol.event_block_frames(run, lines))
            await watcher.events_changed.wait_past(generation, RECHECK_S)
            continue
        found, offset = read_raw(watcher.paths.events, offset)
        batch: list[bytes] = []
        size = 0
        for seq, raw in found:
            if seq > pos:
                batch.append(raw)
                size += len(raw)
                pos = seq
                if size >= EVENT_WRITE_BYTES:
                    await send_bytes(protocol.event_frames(run, batch))
                    batch, size = [], 0
        if batch:
            await send_bytes(protocol.event_frames(run, batch))
        await watcher.events_changed.wait_past(generation, RECHECK_S)


def log_message(run: str, lines: list[tuple[int, str]], next_offset: int) -> dict[str, Any]:
    """The ``log_block`` message for ``lines`` (the splitter's: no text holds a newline)."""
    offsets, texts = map(list, zip(*lines, strict=True))
    return protocol.log_block(run, offsets, "\n".join(texts), next_offset, texts)


async def stream_log(send: Send, watcher: RunWatcher, log_offset: int) -> None:
    """Send complete log lines from stream offset ``log_offset`` on, exactly the lines the watcher split.

    Lines come from the watcher's LineBuffer (agent/logs/linebuffer.py): the log is read and split once, by
    the watcher, however many followers there are.  A follower behind what the buffer holds (a catch-up
    after a long disconnect, or a run that ended before this daemon started) reads the log itself, split
    the same way, until it reaches an offset the buffer serves.  Offsets run on across truncations and
    replacements of output.log (agent/logs/generations.py): where a generation ends, its unterminated last
    line is sent as a line, as the watcher ends it.
    """
    run = watcher.paths.run
    pos = log_offset
    disk: _DiskReader | None = None
    loop = asyncio.get_running_loop()
    sent_at = -LOG_SEND_GAP_S
    while True:
        generation = watcher.log_changed.generation
        got = watcher.lines.read(pos, BLOCK_LINES, BLOCK_BYTES)
        if got is not None:
            disk = None
            lines, nxt = got
            if lines:
                await send(log_message(run, lines, nxt))
                pos, sent_at = nxt, loop.time()
                continue
        else:
            if disk is None or disk.pos != pos:
                disk = _DiskReader(watcher, pos)
            moved = await disk.read_some(send)
            pos = disk.pos
            if moved:
                continue
        await watcher.log_changed.wait_past(generation, RECHECK_S)
        gap = sent_at + LOG_SEND_GAP_S - loop.time()
        if gap > 0:  # a line soon after the last block waits for the lines behind it
            await asyncio.sleep(gap)


class _DiskReader:
    """A follower's own read of the log, for offsets the watcher's buffer no longer (or never) held."""

    def __init__(self, watcher: RunWatcher, pos: int) -> None:
        self.watcher = watcher
        self.splitter = LineSplitter(start_offset=pos)
        self.fed = pos
        self.pos = pos  # the offset after the last line sent
        self.flushed_at = -1

    async def read_some(self, send: Send) -> bool:
        """Read and send one chunk's lines; True when something moved (call again before waiting)."""
        watcher, run = self.watcher, self.watcher.paths.run
        chunk = watcher.chain.read_at(self.fed, READ_CHUNK)
        moved = False
        if chunk.jumped:
            await _send_lines(send, run, self.splitter.flush(), chunk.offset)
            self.splitter = LineSplitter(start_offset=chunk.offset)
            self.fed = self.pos = chunk.offset
            moved = True
        if chunk.data:
            self.fed += len(chunk.data)
            await _send_lines(send, run, self.splitter.feed(chunk.data), self.splitter.pending_offset)
            self.pos = self.splitter.pending_offset
            return True  # read on until the end: a full chunk or a seam may be followed by more
        if chunk.at_end and watcher.summary.terminal is not None and self.flushed_at != self.fed:
            # The job has ended: its unterminated last line is a line now.
            self.flushed_at = self.fed
            lines = self.splitter.flush()
            await _send_lines(send, run, lines, self.splitter.pending_offset)
            self.pos = self.splitter.pending_offset
            moved = bool(lines)
        return moved


async def _send_lines(send: Send, run: str, lines: list[Line], end_offset: int) -> None:
    """Send ``lines`` in blocks; each block's next_offset is where the following unsent line starts."""
    batch: list[tuple[int, str]] = []
    size = 0
    for i, line in enumerate(lines):
        batch.append((line.offset, line.text))
        size += len(line.text) + 16
        if len(batch) >= BLOCK_LINES or size >= BLOCK_BYTES:
            nxt = lines[i + 1].offset if i + 1 < len(lines) else end_offset
            await send(log_message(run, batch, nxt))
            batch, size = [], 0
    if batch:
        await send(log_message(run, batch, end_offset))
