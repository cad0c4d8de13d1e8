"""Per-run append-only journal ``events.jsonl``: one JSON event a line, ``seq`` 1, 2, 3…, fsynced."""

from __future__ import annotations

import json
import os
import threading
import time
from itertools import repeat
from pathlib import Path
from typing import Any

from agent.runs.jsonline import dump_line, encode_lines
from agent.runs.recent import RecentLines

_TAIL_CHUNK = 1 << 16


class Journal:
    """Appends events with consecutive ``seq``; recovers the last seq (and cuts a torn last line) on open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._unsynced = False  # written by append_many(sync=False), not fsynced yet
        self._fd_lock = threading.Lock()  # sync() may run in a worker thread: close() waits for it
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.last_seq = self._recover()  # the last seq written to the file
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

    def append(self, event: dict[str, Any]) -> dict[str, Any]:
        """Give ``event`` the next seq and a timestamp and write it durably."""
        return self.append_many([event])[0]

    def append_many(self, events: list[dict[str, Any]], *, sync: bool = True) -> list[dict[str, Any]]:
        """Append ``events`` with consecutive seqs in one write, then one fsync; return them as written.

        With ``sync=False`` the fsync is left to a later ``sync()``: the events are already in the file for
        every reader (a killed daemon loses nothing written), so followers need not wait for the disk;
        whoever saves a cursor past them calls ``sync()`` first."""
        if not events:
            return []
        ts = round(time.time(), 3)
        full = [{"seq": self.last_seq + 1 + i, "ts": ts, **ev} for i, ev in enumerate(events)]
        data = encode_lines(full)  # an event JSON cannot carry raises here: nothing written, no seq taken
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
        self._unsynced = True
        self.last_seq = full[-1]["seq"]
        self.recent.add(full[0]["seq"], data)
        if sync:
            self.sync()
        return full

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
        """Close the file descriptor (a later append opens it again)."""
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


#: How every line this module writes starts (``append_many`` puts ``seq`` first): a follower reads the seq
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
        # Lines as append_many numbers them (seq after seq): checked against the expected heads, with no
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
