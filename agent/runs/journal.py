"""Per-run append-only journal ``events.jsonl``: one strict-JSON event a line, ``seq`` 1, 2, 3…, fsynced."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from itertools import repeat
from pathlib import Path
from typing import Any

_TAIL_CHUNK = 1 << 16


def _finite(value: Any) -> Any:
    """``value`` with every NaN/Infinity float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# One encoder for every line: json.dumps with options builds a new encoder per call.
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def dump_line(event: dict[str, Any]) -> str:
    """One journal line: strict JSON, since followers (the controller, SSE) must be able to read it."""
    try:
        return _encode(event)
    except ValueError:  # a NaN/Infinity from some check or rule: null is the JSON for "no number"
        return _encode(_finite(event))


# A milestone event as the watcher writes it: its fixed keys go from a template, its fields dict and text
# through the same C encoder _encode uses (no circular check: a cycle ends in RecursionError either way).
_MILESTONE_KEYS = ("seq", "ts", "type", "kind", "line", "rank", "fields", "text")
_MILESTONE_LINE = '{"seq":%d,"ts":%s,"type":%s,"kind":%s,"line":%d,"rank":%s,"fields":%s,"text":%s}\n'
_value = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, json.JSONEncoder().default, json.encoder.encode_basestring, None, ":", ",", False, False, False
)
_string = json.encoder.encode_basestring


def _milestone_line(ev: dict[str, Any], strings: dict[str, str], stamps: dict[int, str]) -> str | None:
    """``ev``'s line as ``dump_line`` writes it, or None where only ``dump_line`` knows (another shape, a
    NaN, a subclass of int or str)."""
    if tuple(ev) != _MILESTONE_KEYS:
        return None
    seq, ts, kind, line, rank, text = ev["seq"], ev["ts"], ev["kind"], ev["line"], ev["rank"], ev["text"]
    typ = ev["type"]
    if not (
        type(seq) is int and type(ts) is float and type(line) is int and type(typ) is str
        and type(kind) is str and type(text) is str and (rank is None or type(rank) is int)
        and math.isfinite(ts)
    ):  # fmt: skip
        return None
    try:
        fields = "".join(_value(ev["fields"], 0))
    except ValueError:  # a NaN or Infinity: dump_line writes it as null
        return None
    # A batch's events share one ts object (alive all the call: its id names it; equality would take
    # -0.0 for 0.0).
    rep_ts = stamps.get(id(ts))
    if rep_ts is None:
        rep_ts = stamps[id(ts)] = repr(ts)
    return _MILESTONE_LINE % (
        seq,
        rep_ts,
        strings.get(typ) or strings.setdefault(typ, _string(typ)),
        strings.get(kind) or strings.setdefault(kind, _string(kind)),
        line,
        "null" if rank is None else rank,
        fields,
        _string(text),
    )


def encode_lines(events: list[dict[str, Any]]) -> bytes:
    """Journal lines for ``events``, each ending in a newline: ``dump_line``'s bytes, milestones (most of
    a backlog's events) built from a template."""
    strings: dict[str, str] = {}  # a batch's few types and kinds, encoded once
    stamps: dict[int, str] = {}
    out: list[str] = []
    for ev in events:
        line = _milestone_line(ev, strings, stamps)
        out.append(line if line is not None else dump_line(ev) + "\n")
    return "".join(out).encode("utf-8")


#: Bytes of the newest journal lines kept per run: a follower that fell further behind reads the file.
RECENT_BYTES = 4 << 20


class RecentLines:
    """The last writes of a journal, each as (first seq, byte offset in the file, its whole lines): a
    follower whose offset is where the write after its seq starts reads from here, any other the file."""

    def __init__(self, end: int) -> None:
        self.end = end  # the file's size: where the next write goes
        self._writes: deque[tuple[int, int, bytes]] = deque()
        self._bytes = 0

    def add(self, first_seq: int, data: bytes) -> None:
        """A write of whole lines, seqs ``first_seq`` on, appended at ``end``."""
        if data:
            self._writes.append((first_seq, self.end, data))
            self._bytes += len(data)
            while self._bytes > RECENT_BYTES and len(self._writes) > 1:
                self._bytes -= len(self._writes.popleft()[2])
        self.end += len(data)

    def after(self, seq: int, offset: int) -> tuple[bytes, int] | None:
        """The lines written after ``seq`` (a follower at byte ``offset`` of the file) and the offset past
        them; ``(b"", offset)`` when nothing was; None when this does not hold them from there."""
        if offset == self.end:
            return b"", offset
        if not self._writes or self._writes[0][0] > seq + 1:  # older than what is kept: no walk through it
            return None
        taken: list[bytes] = []
        for first, start, data in reversed(self._writes):  # a live follower wants the last write or two
            taken.append(data)
            if first <= seq + 1:
                if first == seq + 1 and start == offset:
                    taken.reverse()
                    return b"".join(taken), self.end
                return None
        return None


class Journal:
    """Appends events with consecutive ``seq``; recovers the last seq (and cuts a torn last line) on open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.unsynced = False  # events were written that no fsync has covered yet (append_many(sync=False))
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
        self.unsynced = True
        self.last_seq = full[-1]["seq"]
        self.recent.add(full[0]["seq"], data)
        if sync:
            self.sync()
        return full

    def sync(self) -> None:
        """fsync what was written since the last one (a no-op when nothing waits for it; safe in a worker
        thread)."""
        with self._fd_lock:
            fd = self._fd
            if self.unsynced and fd >= 0:
                # Cleared before the fsync: a write made during it sets it again, for the next sync.
                self.unsynced = False
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


def scan(path: Path) -> list[dict[str, Any]]:
    """Every complete event of a journal file (a torn last line waits; empty when the file is missing)."""
    data, _end = _complete_bytes(path, 0)
    events: list[dict[str, Any]] = []
    for raw in data.splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            events.append(obj)
    return events


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
