"""Per-run append-only journal ``events.jsonl``: one JSON event a line, ``seq`` 1, 2, 3…, fsynced."""

from __future__ import annotations

import json
import logging
import marshal
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

from agent.runs.encoder import EncoderStage, StageError, stage_wanted
from agent.runs.jsonline import dump_line, encode_lines
from agent.runs.recent import RecentLines

log = logging.getLogger("eaglewatch.agent")
_TAIL_CHUNK = 1 << 16


@dataclass
class _Held:
    """A batch sent to the encoder stage: its events as submitted, numbered, and whether it is written."""

    events: list[dict[str, Any]]
    full: list[dict[str, Any]]
    written: bool = False


class Journal:
    """Appends events with consecutive ``seq``; recovers the last seq (and cuts a torn last line) on open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last_seq = 0  # the last seq written to the file
        self._numbered = 0  # the last seq given out: past last_seq while the encoder stage holds events
        self._stage: EncoderStage | None = None
        self._stage_failed = False  # once it breaks, this journal encodes in the daemon
        self._held: deque[_Held] = deque()  # batches sent to the stage, one per reply to come, oldest first
        self.stage_events = 0  # events written as the encoder stage encoded them
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._batch_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        self._unsynced = False  # written by append_many(sync=False), not fsynced yet
        self._fd_lock = threading.Lock()  # sync() may run in a worker thread: close() waits for it
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.last_seq = self._numbered = self._recover()
        self.recent = RecentLines(os.fstat(self._fd).st_size)  # what live followers read, not the file

    def _recover(self) -> int:
        """Cut an unterminated last line (a write torn by a crash) and return the last complete seq."""
        size = os.fstat(self._fd).st_size
        end = size
        tail = b""
        # Walk back in chunks until the last newline (and the line before it) is in view.
        while end > 0:
            start = max(0, end - _TAIL_CHUNK)
            tail = os.pread(self._fd, end - start, start) + tail
            end = start
            if tail.count(b"\n") >= 2 or (end == 0):
                break
        base = end
        cut = tail.rfind(b"\n") + 1  # 0 when there is no newline at all
        if base + cut < size:
            os.ftruncate(self._fd, base + cut)
        for raw in reversed(tail[:cut].splitlines()):
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("seq"), int):
                return int(obj["seq"])
        return 0

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(event)`` after each append (durable, or written and awaiting ``sync()``)."""
        self._listeners.append(listener)

    def subscribe_batches(self, listener: Callable[[list[dict[str, Any]]], None]) -> None:
        """Call ``listener(events)`` once per batch written, after the per-event listeners (a backlog
        writes thousands of events: one call a batch, not one an event)."""
        self._batch_listeners.append(listener)

    def append(self, event: dict[str, Any]) -> dict[str, Any]:
        """Give ``event`` the next seq and a timestamp, write it durably, then tell the listeners."""
        return self.append_many([event])[0]

    def append_many(self, events: list[dict[str, Any]], *, sync: bool = True) -> list[dict[str, Any]]:
        """Append ``events`` with consecutive seqs, one write and one fsync; then tell the listeners.

        With ``sync=False`` the fsync is left to a later ``sync()`` and the listeners are told at once: the
        events are already in the file for every reader (a killed daemon loses nothing written), so
        followers need not wait for the disk; whoever saves a cursor past them calls ``sync()`` first."""
        full = self.write_many(events)
        if sync:
            self.sync()
        self.publish(full)
        return full

    def write_many(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give ``events`` consecutive seqs and write them; no fsync (``sync``), no listener (``publish``).

        Events still in the encoder stage (``submit``) are written first, each batch told to the listeners."""
        self.drain()
        return self._write_new(events)

    def _write_new(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        full = self._number(events)
        try:
            self._write(encode_lines(full), full)
        except BaseException:
            self._numbered = full[0]["seq"] - 1 if full else self._numbered  # its seqs are free again
            raise
        return full

    def _number(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ts = round(time.time(), 3)
        full = [{"seq": self._numbered + 1 + i, "ts": ts, **ev} for i, ev in enumerate(events)]
        self._numbered += len(full)
        return full

    def _write(self, data: bytes, full: list[dict[str, Any]]) -> None:
        if self._fd < 0:  # closed while the run sat idle in a terminal state
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except BaseException:
            self.recent = RecentLines(os.fstat(self._fd).st_size)  # a part may be in: followers read the file
            raise
        self._unsynced = self._unsynced or bool(full)
        if full:
            self.last_seq = full[-1]["seq"]
            self.recent.add(full[0]["seq"], data)
        else:
            self.recent.end += len(data)

    # --- the encoder stage: a backlog's events are encoded in a child process (encoder.py) -----------
    def submit(self, events: list[dict[str, Any]]) -> None:
        """Give ``events`` their seqs now and have the encoder stage make their lines while the caller goes
        on; they are written in order, and the listeners told, by a later ``submit`` or ``drain`` (or
        ``write_many``).  Without a stage (not started yet, not worth it on this host, failed), or while
        it is a full pipe behind, they are written at once, encoded here."""
        if not events:
            return
        stage = self._ready_stage()
        if stage is not None:
            self._reap(stage)
            stage = self._stage  # None if the reap found it gone
        if stage is None:
            self.publish(self.write_many(events))
            return
        full = self._number(events)
        try:
            payload: bytes | None = marshal.dumps(full)
        except ValueError:  # a value marshal does not carry (e.g. a subclass of str)
            payload = None
        if payload is None or stage.in_flight + len(payload) > stage.limit:
            self._numbered = full[0]["seq"] - 1
            self.publish(self.write_many(events))
            return
        try:
            stage.send(payload)
        except StageError as exc:
            self._numbered = full[0]["seq"] - 1
            self._end_stage(exc)
            self.publish(self.write_many(events))
            return
        self._held.append(_Held(events, full))

    def drain(self) -> None:
        """Write (and tell the listeners about) every event submitted: the lines that came back, and the
        rest encoded here at once rather than waited for (the stage's own lines for them are dropped)."""
        if not self._held:
            return
        if self._stage is not None:
            self._reap(self._stage)
        for i, held in enumerate(self._held):
            if not held.written:
                self._steal(i)
                break

    def start_stage(self) -> None:
        """Start the encoder stage now where it is wanted (encoder.stage_wanted), so that a first backlog
        finds it ready (a child takes ~0.1 s to start)."""
        self._ready_stage()

    def _ready_stage(self) -> EncoderStage | None:
        """The encoder stage once it has started (started here on first use), else None."""
        if self._stage_failed:
            return None
        try:
            if self._stage is None:
                if not stage_wanted():
                    return None
                self._stage = EncoderStage()
            if self._stage.ready:
                return self._stage
            if self._stage.poll_ready():
                log.info("journal %s: encoder stage started (pid %d)", self.path, self._stage.pid)
                return self._stage
            return None
        except (OSError, StageError, ValueError) as exc:  # ValueError: a bad EAGLEWATCH_AGENT_ENCODER
            self._end_stage(exc)
            return None

    def _reap(self, stage: EncoderStage) -> None:
        """Write the batches whose lines have come back, oldest first (never waits)."""
        try:
            replies = stage.replies()
        except StageError as exc:
            self._end_stage(exc)
            return
        for ok, lines in replies:
            held = self._held.popleft()
            if held.written:  # encoded here meanwhile
                continue
            if not ok:  # encoded here, where the same error is raised (the stage's replies end with it)
                self._held.appendleft(held)
                self._end_stage(None)
                return
            self._write(lines, held.full)
            held.written = True
            self.stage_events += len(held.full)
            self.publish(held.full)

    def _steal(self, first: int) -> None:
        """Encode here and write the held batches from index ``first`` on, in order.  A batch that cannot
        be encoded is dropped, as write_many drops it, and the later ones take its seqs; then it raises."""
        held = list(self._held)[first:]
        for i, batch in enumerate(held):
            try:
                data = encode_lines(batch.full)
            except (TypeError, ValueError, RecursionError):
                for later in held[i:]:
                    later.written = True  # their replies, if any come, are dropped
                self._numbered = self.last_seq
                for later in held[i + 1 :]:
                    self.publish(self._write_new(later.events))
                raise
            self._write(data, batch.full)
            batch.written = True
            self.publish(batch.full)

    def _end_stage(self, exc: Exception | None) -> None:
        """End the stage and write what it held, encoded here; with ``exc`` (it broke) use no stage again,
        else (an event it could not encode) the next ``submit`` starts another."""
        if exc is not None:
            log.warning("journal %s: encoder stage failed (%s); encoding in the daemon", self.path, exc)
            self._stage_failed = True
        if self._stage is not None:
            self._stage.close()
            self._stage = None
        try:
            if self._held:
                self._steal(0)
        finally:
            self._held.clear()

    def publish(self, full: list[dict[str, Any]]) -> None:
        """Tell the listeners about events written (by ``write_many``)."""
        if self._listeners:
            for ev in full:
                for listener in list(self._listeners):
                    listener(ev)
        if full:
            for batch_listener in list(self._batch_listeners):
                batch_listener(full)

    @property
    def unsynced(self) -> bool:
        """Whether events were written that no fsync has covered yet."""
        return self._unsynced

    def sync(self) -> None:
        """fsync what was written since the last one (a no-op when nothing waits for it; safe in a worker
        thread)."""
        with self._fd_lock:
            fd = self._fd
            if self._unsynced and fd >= 0:
                # Cleared before the fsync: a write made during it sets it again, for the next sync.
                self._unsynced = False
                os.fsync(fd)

    def close(self) -> None:
        """Write what the encoder stage holds, end the stage, close the file descriptor (a later append
        opens it again)."""
        try:
            self.drain()
        finally:
            if self._stage is not None:
                self._stage.close()
                self._stage = None
                log.info("journal %s: the encoder stage encoded %d events", self.path, self.stage_events)
            self._held.clear()
        with self._fd_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _complete_bytes(path: Path, byte_offset: int) -> tuple[bytes, int]:
    """The complete lines from ``byte_offset`` on (a torn last line waits), and the offset after them."""
    try:
        with open(path, "rb") as fh:
            fh.seek(byte_offset)
            data = fh.read()
    except FileNotFoundError:
        return b"", byte_offset
    cut = data.rfind(b"\n") + 1
    return data[:cut], byte_offset + cut


def _complete_lines(path: Path, byte_offset: int) -> tuple[list[bytes], int]:
    """The complete lines from ``byte_offset`` on, and the offset after them."""
    data, end = _complete_bytes(path, byte_offset)
    return data.splitlines(), end


def read_events(path: Path, byte_offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete events from ``byte_offset`` on, and the offset after the last complete line."""
    lines, end = _complete_lines(path, byte_offset)
    events: list[dict[str, Any]] = []
    for raw in lines:
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            events.append(obj)
    return events, end


#: How every line this module writes starts (``write_many`` puts ``seq`` first): a follower reads the seq
#: from it without decoding the line.
_SEQ_PREFIX = b'{"seq":'
_SEQ_HEAD = b'{"seq":%d,'


def _line_seq(raw: bytes) -> tuple[int, bytes] | None:
    """``raw``'s seq and the strict JSON to forward for it; None for a line that is no event with a seq."""
    if raw.startswith(_SEQ_PREFIX) and raw.endswith(b"}"):
        digits = raw[len(_SEQ_PREFIX) : raw.find(b",", len(_SEQ_PREFIX))]
        if digits.isdigit():  # ASCII digits only: int() would also take spaces, signs and underscores
            return int(digits), raw
    try:  # a line written some other way: decode it once, forward it as this module writes lines
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or type(obj.get("seq")) is not int:
        return None
    return obj["seq"], dump_line(obj).encode("utf-8")


def read_raw(path: Path, byte_offset: int = 0) -> tuple[list[tuple[int, bytes]], int]:
    """Complete events from ``byte_offset`` on as ``(seq, line)`` (strict JSON, undecoded: a follower
    forwards them as they are), and the offset after the last complete line."""
    data, end = _complete_bytes(path, byte_offset)
    lines = data.splitlines()
    first = _line_seq(lines[0]) if lines and lines[0].startswith(_SEQ_PREFIX) else None
    if first is not None:
        # Lines as write_many numbers them (seq after seq): checked against the expected heads, with no
        # Python call per line.
        seqs = range(first[0], first[0] + len(lines))
        heads = map(_SEQ_HEAD.__mod__, seqs)
        if all(map(bytes.startswith, lines, heads)) and all(map(bytes.endswith, lines, repeat(b"}"))):
            return list(zip(seqs, lines, strict=True)), end
    found = map(_line_seq, lines)
    return [item for item in found if item is not None], end


def scan(path: Path) -> list[dict[str, Any]]:
    """Every complete event of a journal file (empty when the file is missing)."""
    return read_events(path, 0)[0]
