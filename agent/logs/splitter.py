"""Incremental, pure log-line splitter: bytes in, decoded lines with byte offsets (or raw blocks of them) out.

docs/milestones.md says how lines are split, decoded and capped; a capped ``Line`` is ``truncated`` and its
text ends with a marker naming how many bytes were dropped.  ``Line.offset`` is the byte offset of the
line's first byte in the file; ``pending_offset``, that of the first byte not yet emitted in a line:
persist it and resume with ``LineSplitter(start_offset=pending_offset)``, nothing lost or repeated.  A
chunk ending in ``\\r`` holds that line back until the next byte shows whether the terminator is ``\\r`` or
``\\r\\n`` (``flush()`` releases it); otherwise a restart between the two bytes would invent an empty line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import add
from typing import overload

#: ASCII digits folded to ``0``: a line's shape (same length as the line; the rules' prefilter key).
DIGIT_FOLD = bytes.maketrans(b"123456789", b"000000000")


@dataclass(frozen=True, slots=True)
class Block:
    """Complete lines kept as raw bytes: ``data`` holds them, each ended by ``\\n``, from stream ``offset``.

    Every line is valid UTF-8 with no ``\\r``, no escape byte and at most the cap, so its text is its bytes
    decoded. ``shapes`` holds each line's bytes with ASCII digits folded to ``0`` (``DIGIT_FOLD``): one C
    split of the whole block, which gives the lines' count and lengths without decoding anything.
    """

    offset: int
    data: bytes
    shapes: list[bytes]

    @property
    def lines(self) -> int:
        """How many lines the block holds."""
        return len(self.shapes)

    @property
    def end(self) -> int:
        """The offset after the block's last line."""
        return self.offset + len(self.data)

    def texts(self) -> list[str]:
        """Every line's text (one decode and one split in C)."""
        texts = self.data.decode("utf-8").split("\n")
        texts.pop()
        return texts


def clean_block(data: bytes, offset: int, max_line_bytes: int) -> Block | None:
    """``data`` (complete lines, ending in ``\\n``) as a Block, or None when some line needs the splitter."""
    if b"\r" in data or b"\x1b" in data:
        return None
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    shapes = data.translate(DIGIT_FOLD).split(b"\n")
    shapes.pop()
    if (
        len(data) > max_line_bytes
        and not _short_lines(data, max_line_bytes)
        and max(map(len, shapes)) > max_line_bytes
    ):
        return None
    return Block(offset, data, shapes)


def _short_lines(data: bytes, cap: int) -> bool:
    """True when every line of ``data`` is surely shorter than ``cap`` bytes: each aligned window of
    ``cap // 2`` bytes holds a newline, so a line (which starts in one window and ends by the end of the
    next) has at most ``2 * (cap // 2) - 1`` bytes.  A few C searches instead of a pass over every line;
    False only means "look at each line"."""
    step = cap // 2
    if step < 1:
        return False
    find = data.find
    return all(find(b"\n", at, at + step) >= 0 for at in range(0, len(data), step))


class BlockLines(Sequence[str]):
    """The texts of a Block's lines, decoded one by one when asked for (cheapest in ascending order)."""

    def __init__(self, block: Block) -> None:
        self._data = block.data
        self._shapes = block.shapes
        self._i = 0  # the line whose start is _at
        self._at = 0

    def __len__(self) -> int:
        return len(self._shapes)

    def _text(self, i: int) -> str:
        if i < 0:
            i += len(self._shapes)
        if not 0 <= i < len(self._shapes):
            raise IndexError(i)
        if i < self._i:
            self._i = self._at = 0
        if i > self._i:  # the lengths of the lines between, summed in C
            self._at += sum(map(len, self._shapes[self._i : i])) + (i - self._i)
            self._i = i
        size = len(self._shapes[i])
        return self._data[self._at : self._at + size].decode("utf-8")

    def texts_at(self, indices: Sequence[int]) -> list[str]:
        """The texts of the lines ``indices`` (ascending): each line's start summed from the lengths of the
        lines before it in C, a decode per line asked for."""
        data, shapes, out = self._data, self._shapes, []
        at = prev = 0
        for i in indices:
            if i > prev:
                at += sum(map(len, shapes[prev:i])) + (i - prev)
            end = at + len(shapes[i])
            out.append(data[at:end].decode("utf-8"))
            at, prev = end + 1, i + 1
        return out

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._text(j) for j in range(*i.indices(len(self)))]
        return self._text(i)


DEFAULT_MAX_LINE_BYTES = 65536

# CSI (colours, cursor moves), OSC (titles, hyperlinks) and two-byte escapes.
_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_EOL_RE = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class Line:
    """One log line: byte offset of its start, decoded text, and whether it was cut at the cap."""

    offset: int
    text: str
    truncated: bool = False


# Building a frozen dataclass goes through object.__setattr__ per field; the hot loop fills the slots
# directly instead (same object, about twice as fast to build).
_new_object = object.__new__
_set_offset = vars(Line)["offset"].__set__
_set_text = vars(Line)["text"].__set__
_set_truncated = vars(Line)["truncated"].__set__


def _plain_line(offset: int, text: str) -> Line:
    line = _new_object(Line)
    _set_offset(line, offset)
    _set_text(line, text)
    _set_truncated(line, False)
    return line


def _utf8_boundary(raw: bytes) -> int:
    """Length of the longest prefix of ``raw`` that does not end inside a multi-byte UTF-8 character."""
    n = len(raw)
    back = 0
    while back < 3 and back < n and (raw[n - 1 - back] & 0xC0) == 0x80:
        back += 1
    lead_at = n - 1 - back
    if lead_at < 0:
        return n
    lead = raw[lead_at]
    need = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if lead >= 0xF0 else 1
    return lead_at if need > back + 1 else n


def _decode(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    return _ANSI_RE.sub("", text) if "\x1b" in text else text


class LineSplitter:
    """Split a byte stream into ``Line`` objects incrementally; see the module docstring."""

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, start_offset: int = 0) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
        if start_offset < 0:
            raise ValueError(f"start_offset must be >= 0, got {start_offset}")
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()  # kept bytes of the current, unterminated line (<= max_line_bytes)
        self._dropped = 0  # bytes of the current line dropped past the cap
        self._start = start_offset  # offset of the current line's first byte
        self._pos = start_offset  # offset just past the last byte fed
        self._cr = False  # the current line ended with a \r at the very end of the last chunk

    @property
    def pending_offset(self) -> int:
        """Offset of the first byte not yet emitted as part of a line (persist this to resume)."""
        return self._start

    def _make(self, offset: int, raw: bytes, dropped: int) -> Line:
        cap = self.max_line_bytes
        if len(raw) > cap:
            dropped += len(raw) - cap
            raw = raw[:cap]
        if not dropped:
            return Line(offset, _decode(raw), False)
        keep = _utf8_boundary(raw)
        dropped += len(raw) - keep
        text = _decode(raw[:keep]) + f" […line truncated: {dropped} bytes dropped]"
        return Line(offset, text, True)

    def _take_partial(self, tail: bytes) -> tuple[bytes, int]:
        """The current partial line completed by ``tail``; resets the partial state."""
        raw = bytes(self._buf) + tail if self._buf else tail
        dropped = self._dropped
        self._buf.clear()
        self._dropped = 0
        return raw, dropped

    def _append_partial(self, piece: bytes) -> None:
        room = self.max_line_bytes - len(self._buf)
        if len(piece) <= room:
            self._buf += piece
        else:
            if room > 0:
                self._buf += piece[:room]
            self._dropped += len(piece) - max(room, 0)

    def _complete_lines(self, data: bytes, parts: list[bytes], cur: int, tail: int, out: list[Line]) -> int:
        """Append the lines parts[1:] (from offset ``cur``) to ``out``; return the offset after them."""
        cap = self.max_line_bytes
        if data.isascii() and b"\x1b" not in data:
            # Plain ASCII: decode the whole run of lines at once; byte offsets equal character offsets.
            texts = data[len(parts[0]) + 1 : len(data) - tail - 1].decode("ascii").split("\n")
            if max(map(len, texts)) <= cap:
                n = len(texts)
                offsets = map(add, accumulate(map(len, texts), initial=0), range(cur, cur + n))
                out.extend(map(_plain_line, offsets, texts))
                return cur + sum(map(len, texts)) + n
        append = out.append
        for p in parts[1:]:
            if len(p) > cap:
                append(self._make(cur, p, 0))
            else:
                t = p.decode("utf-8", "replace")
                if "\x1b" in t:
                    t = _ANSI_RE.sub("", t)
                append(_plain_line(cur, t))
            cur += len(p) + 1
        return cur

    def feed(self, data: bytes) -> list[Line]:
        """Consume a chunk; return the lines it completed, in order."""
        out: list[Line] = []
        if not data:
            return out
        base = self._pos
        self._pos += len(data)
        if self._cr:
            self._cr = False
            raw, dropped = self._take_partial(b"")
            skip = 1 if data[0] == 0x0A else 0
            out.append(self._make(self._start, raw, dropped))
            if skip:
                data = data[1:]
                base += 1
            self._start = base
            if not data:
                return out
        make = self._make
        if b"\r" not in data:
            parts = data.split(b"\n")
            last = parts.pop()
            if parts:
                first = parts[0]
                raw, dropped = self._take_partial(first)
                out.append(make(self._start, raw, dropped))
                cur = base + len(first) + 1
                if len(parts) > 1:
                    cur = self._complete_lines(data, parts, cur, len(last), out)
                self._start = cur
            self._append_partial(last)
            return out
        cur = 0
        n = len(data)
        is_first = True
        for m in _EOL_RE.finditer(data):
            piece = data[cur : m.start()]
            if m.end() == n and m.group() == b"\r":
                # Hold the line back: the next chunk may start with the \n of a \r\n.
                self._append_partial(piece)
                self._cr = True
                return out
            if is_first:
                raw, dropped = self._take_partial(piece)
                out.append(make(self._start, raw, dropped))
                is_first = False
            else:
                out.append(make(base + cur, piece, 0))
            cur = m.end()
            self._start = base + cur
        self._append_partial(data[cur:])
        return out

    def feed_block(self, data: bytes) -> tuple[list[Line], Block | None]:
        """Consume a chunk; return the lines it completed: first as ``Line`` objects, then (when not None) a
        ``Block`` of the rest.  The same lines as ``feed`` gives, in the same order, with the same texts."""
        first = data.find(b"\n")
        last = data.rfind(b"\n")
        if first == last or self._cr or b"\r" in data:  # a \r anywhere: the general path ends every line
            return self.feed(data), None
        head = self.feed(data[: first + 1])  # completes the pending partial line
        block = clean_block(data[first + 1 : last + 1], self._start, self.max_line_bytes)
        if block is None:
            head += self.feed(data[first + 1 :])
            return head, None
        self._start = self._pos = block.end
        self.feed(data[last + 1 :])  # no line ends in it: only kept as the partial line
        return head, block

    def flush(self) -> list[Line]:
        """Emit the unterminated final line, if any (at job end)."""
        if not self._cr and not self._buf and not self._dropped:
            return []
        raw, dropped = self._take_partial(b"")
        line = self._make(self._start, raw, dropped)
        self._cr = False
        self._start = self._pos
        return [line]
